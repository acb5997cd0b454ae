"""The one list of this package's proposers, each addressed as ``vllm_retrieval_spec.<name>`` in
``--speculative-config``: the package top level, the command line and the integration read it.
Imports nothing, so that importing the package stays cheap."""

from __future__ import annotations

from dataclasses import dataclass

PACKAGE = "vllm_retrieval_spec"


@dataclass(frozen=True)
class RegisteredProposer:
    """A proposer class, the module defining it and the options naming the stores it opens at
    start (checked before serving)."""

    name: str
    module: str
    store_options: tuple[str, ...] = ()

    @property
    def path(self) -> str:
        """How ``--speculative-config`` names it."""
        return f"{PACKAGE}.{self.name}"


PROPOSERS = {
    proposer.name: proposer
    for proposer in (
        RegisteredProposer("PromptLookupProposer", f"{PACKAGE}.proposers.prompt_lookup"),
        RegisteredProposer("RestProposer", f"{PACKAGE}.proposers.rest", ("datastore",)),
        RegisteredProposer("DReSDProposer", f"{PACKAGE}.proposers.dresd", ("dense_datastore",)),
        RegisteredProposer("HybridProposer", f"{PACKAGE}.proposers.hybrid", ("datastore", "dense_datastore")),
        RegisteredProposer("NGrammysProposer", f"{PACKAGE}.proposers.ngrammys", ("ngram_table",)),
    )
}


def names_this_package(path: object) -> bool:
    """Whether a ``--speculative-config`` model path points into this package."""
    return isinstance(path, str) and path.startswith(f"{PACKAGE}.")


def registered_proposer(path: object) -> RegisteredProposer | None:
    """The proposer a ``--speculative-config`` model path names, None for any other path."""
    if not names_this_package(path):
        return None
    return PROPOSERS.get(path[len(PACKAGE) + 1:])
