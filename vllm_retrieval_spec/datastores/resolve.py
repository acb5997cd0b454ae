"""From the ``datastore`` option to an open store checked against the served tokenizer."""

from __future__ import annotations

from pathlib import Path

from vllm_retrieval_spec.datastores.format import DatastoreError, TokenizerIdentity
from vllm_retrieval_spec.datastores.reader import TokenDatastore
from vllm_retrieval_spec.datastores.recipes import available_recipes, recipe_store_dir
from vllm_retrieval_spec.datastores.sharded import ShardedDatastore, open_datastore


def tokenizer_identity(tokenizer_dir: str | Path) -> TokenizerIdentity:
    """Identity of the tokenizer a model directory (or tokenizer directory) serves with."""
    return TokenizerIdentity.of_directory(tokenizer_dir)


def as_directory(option: str) -> Path | None:
    """The directory ``option`` names when it is a path (it exists or has a slash), else None."""
    path = Path(option).expanduser()
    return path if path.exists() or "/" in option else None


def resolve_datastore_dir(option: str, tokenizer: TokenizerIdentity) -> Path:
    """A directory path is used as given; a recipe name maps to its cached build."""
    path = as_directory(option)
    if path is not None:
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


def open_datastore_for_model(option: str,
                             tokenizer_dir: str | Path) -> tuple[TokenDatastore | ShardedDatastore, TokenizerIdentity]:
    """Open the store (single-array or sharded) named by ``option`` and check it against the
    model's tokenizer. A store given by path is opened before the tokenizer loads, so a missing or
    corrupt one fails at once."""
    path = as_directory(option)
    if path is None:
        identity = tokenizer_identity(tokenizer_dir)
        return open_datastore(resolve_datastore_dir(option, identity), expected_tokenizer=identity), identity
    store = open_datastore(path)
    identity = tokenizer_identity(tokenizer_dir)
    store.check_tokenizer(identity)
    return store, identity


def ensure_recipe_store(name: str, tokenizer_dir: str | Path) -> Path:
    """The recipe's store for this tokenizer, built into the cache first if missing."""
    from vllm_retrieval_spec.datastores.builder import build_datastore
    from vllm_retrieval_spec.datastores.recipes import load_recipe

    store_dir = recipe_store_dir(name, tokenizer_identity(tokenizer_dir))
    if not store_dir.exists():
        recipe = load_recipe(name)
        print(f"building the {name!r} datastore (once): {recipe.description}", flush=True)
        build_datastore(tokenizer_dir, recipe.input_specs(), store_dir, extra_build_info={"recipe": name})
    return store_dir
