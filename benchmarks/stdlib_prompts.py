"""Prompts for in-distribution datastores, disjoint from HumanEval and offline: functions of the
CPython standard library that have a docstring, cut to what a HumanEval prompt looks like (the
signature and the docstring; the body left for the model), raw or chat-wrapped exactly as the
benchmarks wrap HumanEval. Functions named like a HumanEval entry point are left out.

    python benchmarks/stdlib_prompts.py --count 200 --form both --out benchmarks/prompts/stdlib.jsonl

Then answer them with any server and build the stores (see README, "Datastores"):

    vllm-retrieval-spec datastore from-server --url http://127.0.0.1:8000 --prompts
        benchmarks/prompts/stdlib.jsonl --out DIR --model MODEL_DIR --dense   (one command line)
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from vllm_retrieval_spec.evaluation.prompts import CHAT_INSTRUCTION, humaneval_problems

SKIPPED_DIRECTORIES = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo"}
MIN_DOCSTRING_CHARS = 40


def stdlib_functions(stdlib: Path) -> Iterator[tuple[str, str]]:
    """``(name, prompt)`` of every public function with a docstring, in path order."""
    for path in sorted(stdlib.rglob("*.py")):
        if SKIPPED_DIRECTORIES & set(path.relative_to(stdlib).parts[:-1]):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                    yield node.name, signature_and_docstring(node, doc)


def signature_and_docstring(node: ast.FunctionDef, doc: str) -> str:
    """``def name(args):`` and the docstring, indented, as HumanEval prompts end."""
    body = "\n".join(f"    {line}" if line else "" for line in doc.splitlines())
    return f"def {node.name}({ast.unparse(node.args)}):\n    \"\"\"{body.lstrip()}\n    \"\"\"\n"


def prompt_records(count: int, form: str, seed: int) -> list[dict]:
    """``count`` sampled functions as ``{"prompt"}`` and/or ``{"messages"}`` records."""
    excluded = {problem["entry_point"] for problem in humaneval_problems()}
    functions = [(n, p) for n, p in stdlib_functions(Path(sysconfig.get_paths()["stdlib"])) if n not in excluded]
    chosen = random.Random(seed).sample(functions, min(count, len(functions)))
    records = []
    for _, prompt in chosen:
        if form in ("raw", "both"):
            records.append({"prompt": prompt})
        if form in ("chat", "both"):
            records.append({"messages": [{"role": "user", "content": f"{CHAT_INSTRUCTION}\n\n```python\n{prompt}```"}]})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    parser.add_argument("--count", type=int, default=200, help="functions to sample (default 200)")
    parser.add_argument("--form", choices=["raw", "chat", "both"], default="both")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    records = prompt_records(args.count, args.form, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    print(f"wrote {args.out}: {len(records)} prompts from {args.count} standard-library functions ({args.form})")


if __name__ == "__main__":
    main()
