"""From the ``datastore`` option to an open store checked against the served tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_retrieval_spec.datastores.format import DatastoreError, TokenizerIdentity
from vllm_retrieval_spec.datastores.reader import TokenDatastore
from vllm_retrieval_spec.datastores.recipes import available_recipes, recipe_store_dir


def tokenizer_identity(tokenizer_dir: str | Path) -> TokenizerIdentity:
    """Identity of the tokenizer a model directory (or tokenizer directory) serves with."""
    from transformers import AutoTokenizer

    return TokenizerIdentity.of(AutoTokenizer.from_pretrained(str(tokenizer_dir)), name=Path(tokenizer_dir).name)


def resolve_datastore_dir(option: str, tokenizer: TokenizerIdentity) -> Path:
    """A directory path is used as given; a recipe name maps to its cached build."""
    path = Path(option).expanduser()
    if path.exists() or "/" in option:
        return path
    if option in available_recipes():
        store_dir = recipe_store_dir(option, tokenizer)
        if not store_dir.exists():
            raise DatastoreError(
                f"the {option!r} datastore for tokenizer {tokenizer.name!r} is not built yet "
                f"(expected at {store_dir}); build it with "
                f"`vllm-retrieval-spec datastore build --recipe {option} --tokenizer MODEL_DIR`"
            )
        return store_dir
    raise DatastoreError(
        f"datastore {option!r} is neither a directory nor a recipe ({', '.join(available_recipes())})"
    )


def open_datastore_for_model(option: str, tokenizer_dir: str | Path) -> tuple[TokenDatastore, Any]:
    """Open the store named by ``option`` and check it against the model's tokenizer."""
    identity = tokenizer_identity(tokenizer_dir)
    return TokenDatastore.open(resolve_datastore_dir(option, identity), expected_tokenizer=identity), identity
