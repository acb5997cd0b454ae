"""``vllm-retrieval-spec datastore build-dense``: its flags and what it runs (imported by
``cli.py``; nothing heavy is imported until the command runs)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

OPTION_FLAGS = {  # DenseBuildOptions field -> help (all default to the recipe's value, else the builder's)
    "value_tokens": "tokens stored after each position (default 10)",
    "stride": "keep every n-th position of a document (default 1: all)",
    "dim": "PCA dimensions of the keys (default 64, the paper's)",
    "fit_sample": "hidden states the z-normalisation and PCA are fitted on (default 100000)",
    "window": "tokens per forward window (default 512)",
    "overlap": "context tokens a window repeats from the previous one (default 128)",
    "batch_tokens": "tokens per forward batch (default 4096)",
    "document_stride": "take every n-th document of the inputs (default 1: all)",
    "flat_max": "exact IndexFlatIP up to this many positions, IVF above (default 16384)",
    "index_memory": "bytes of IVF vectors above which keys are PQ-compressed (default 4 GiB)",
    "nlist": "IVF lists (default: a power of two near 4·sqrt(positions))",
    "nprobe": "IVF lists probed per query by default (default: nlist / 16, at most 64)",
}


def add_build_dense_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``datastore build-dense``."""
    from vllm_retrieval_spec.datastores.sources import add_input_arguments

    parser.add_argument("--model", required=True, help="model directory (its hidden states are the keys)")
    add_input_arguments(parser, "python-code-dense")
    for name, help_text in OPTION_FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=None, help=help_text)
    parser.add_argument("--replace", action="store_true",
                        help="rebuild an existing store (only a dense store or an empty directory is replaced)")


def run_build_dense(args: argparse.Namespace) -> None:
    """Build the inputs or the recipe and print what was built and how fast."""
    from vllm_retrieval_spec.datastores.dense_builder import DenseBuildOptions, build_dense_datastore
    from vllm_retrieval_spec.datastores.dense_format import DENSE_DATASTORE, dense_recipe_store_dir
    from vllm_retrieval_spec.datastores.recipes import load_recipe
    from vllm_retrieval_spec.datastores.sources import input_specs_of
    from vllm_retrieval_spec.storage import ModelIdentity, check_build_target

    if bool(args.recipe) == bool(args.input):
        raise ValueError("datastore build-dense: give either --recipe NAME or --input PATH ...")
    options, extra = DenseBuildOptions(), {}
    if args.recipe:
        recipe = load_recipe(args.recipe)
        options = DenseBuildOptions.from_mapping(recipe_dense_section(recipe.name), f"recipe {recipe.name!r}")
        out = Path(args.out) if args.out else dense_recipe_store_dir(recipe.name, ModelIdentity.of(args.model))
        check_build_target(out, args.replace, DENSE_DATASTORE)  # before the recipe's inputs are fetched
        inputs, extra = recipe.input_specs(), {"recipe": recipe.name}
    else:
        if not args.out:
            raise ValueError("datastore build-dense: --out DIR is required with --input")
        inputs = input_specs_of(args)
        out = Path(args.out)
    given = {name: getattr(args, name) for name in OPTION_FLAGS if getattr(args, name, None) is not None}
    report = build_dense_datastore(args.model, inputs, out, dataclasses.replace(options, **given),
                                   replace=args.replace, extra_build_info=extra)
    print(describe_build(report))


def recipe_dense_section(name: str) -> dict[str, Any]:
    """The ``dense`` build options of a recipe (empty when it has none)."""
    from vllm_retrieval_spec.datastores.recipes import recipe_directories

    for directory in recipe_directories():
        path = directory / f"{name}.json"
        if path.is_file():
            section = json.loads(path.read_text()).get("dense", {})
            if not isinstance(section, dict):
                raise ValueError(f"{path}: 'dense' must be a JSON object of build options")
            return section
    return {}


def describe_build(report: Any) -> str:
    """One summary line of a :class:`~vllm_retrieval_spec.datastores.dense_builder.DenseBuildReport`."""
    m = report.manifest
    return (f"built {report.path}: {report.num_positions:,} positions ({m.value_tokens} value tokens, stride "
            f"{m.build['options']['stride']}) from {report.num_tokens:,} tokens, {report.num_documents:,} documents "
            f"({report.files_read:,} file(s), {report.files_skipped:,} binary skipped) in {report.seconds:.1f} s "
            f"({report.positions_per_second:,.0f} positions/s in the model), keys {m.dim}-d, "
            f"PCA explains {m.transform['explained_variance']:.0%} of the variance, index {m.index.describe()}; "
            f"{report.bytes_on_disk / 1e6:.1f} MB, {report.bytes_per_position:.1f} bytes/position")
