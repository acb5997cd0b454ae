"""Token datastores for exact-match retrieval: on-disk format, builder, reader."""

from vllm_retrieval_spec.datastores.format import DatastoreError, TokenizerIdentity
from vllm_retrieval_spec.datastores.reader import TokenDatastore

__all__ = ["DatastoreError", "TokenDatastore", "TokenizerIdentity"]
