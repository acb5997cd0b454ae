"""``datastore from-server`` without ``--url``: this package's own server answers the prompts,
and with ``--dense`` DReSD's learned index captures the target's hidden state of every generated
token while it answers (issue 25: no second forward pass over the transcripts), saved as
snapshots under ``states`` at shutdown (and every ``output_index_save_seconds``, so a killed run
resumes with what it captured) that the dense store is then built from."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vllm_retrieval_spec.evaluation.server import ServerError, VllmServer
from vllm_retrieval_spec.options import LEARNED_POSITIONS_MAX

SNAPSHOT_STOP_SECONDS = 90  # the server's orderly shutdown, in which the captured states are saved
CAPTURE_DRAFT_TOKENS = 8  # DReSD's drafts while answering (lossless: the answers are the model's own)


def check_capture_fits(concurrency: int, answer_tokens: int) -> None:
    """Fail, naming the flags, when the answers in flight could hold more positions than the
    learned index keeps waiting (the oldest would be lost without a word)."""
    from vllm_retrieval_spec.proposers.dense_source import LEARNED_PENDING_KEYS

    if concurrency * answer_tokens > LEARNED_PENDING_KEYS:
        raise ValueError(f"--concurrency {concurrency} x --max-tokens (with the overshoot of a last step, "
                         f"{answer_tokens} positions an answer) exceeds the {LEARNED_PENDING_KEYS:,} positions capture "
                         "keeps waiting; lower either, or give --url to compute the keys with a forward pass")


def _check_capture_keys(model: str | Path, dense_keys: str) -> None:
    """Fail before the server starts when ``dense_keys`` (``--dense-keys``) is neither a directory
    nor a dense recipe built for ``model`` (the error names the recipe's build command), where the
    server would exit with the reason in its log."""
    from vllm_retrieval_spec.datastores.dense import resolve_dense_datastore_dir
    from vllm_retrieval_spec.datastores.dense_format import DenseDatastoreError
    from vllm_retrieval_spec.storage import ModelIdentity

    path = resolve_dense_datastore_dir(dense_keys, ModelIdentity.of(model))
    if not path.is_dir():
        raise DenseDatastoreError(f"--dense-keys {dense_keys}: no dense datastore there (a directory "
                                  "`datastore build-dense` wrote, or a dense recipe's name)")


@contextmanager
def answering_server(model: str | Path, *, max_model_len: int, states: Path | None = None,
                     capacity: int = 0, dense_keys: str = "") -> Iterator[str]:
    """``vllm-retrieval-spec serve MODEL`` here, stopped on exit; its base URL. With ``states``:
    DReSD over the dense datastore ``dense_keys`` (whose transform makes the keys), learning up to
    ``capacity`` positions and saving them under ``states``."""
    speculative = additional = None
    if states is not None:
        _check_capture_keys(model, dense_keys)
        speculative = {"model": "vllm_retrieval_spec.DReSDProposer", "num_speculative_tokens": CAPTURE_DRAFT_TOKENS}
        additional = {"retrieval_spec": {"dense_datastore": dense_keys, "dense_learned_path": str(states),
                                         "dense_learned_positions": min(max(capacity, 2), LEARNED_POSITIONS_MAX),
                                         "dense_learned_neighbours": 0}}  # capture only: searching costs
    server = VllmServer(model, speculative_config=speculative, additional_config=additional,
                        max_model_len=max_model_len)
    print(f"starting vllm-retrieval-spec serve {model} (log: {server.log_path}) ...", flush=True)
    try:
        server.start()
    except ServerError as error:
        reason = _first_error_line(str(error))
        raise ValueError(f"the server did not start ({reason}); see {server.log_path}") from error
    try:
        yield server.base_url
    finally:
        server.stop(graceful_s=SNAPSHOT_STOP_SECONDS)


def _first_error_line(message: str) -> str:
    """The line of a server's exit message (its log's tail) that says why: a command-line refusal
    (``PROG: error: ...``, ours or argparse's), else the first naming an ``Error``, else the first."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    refusal = next((line for line in lines if ": error: " in line), None)
    return refusal or next((line for line in lines if "Error" in line), lines[0] if lines else message)
