"""The training reader: packed MDS samples -> input_ids / labels / position_ids / doc_spans per DP rank,
with a checkpointable cursor. Reads any ProLong-schema MDS folder (ProLong's own data included).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Iterator

import numpy as np
import torch

from mtrain.data.mds import MDSFolder, read_manifest, shard_checksums
from mtrain.errors import MtrainError

IGNORE_INDEX = -100


def sample_to_tensors(input_ids: np.ndarray, indices: np.ndarray | None, *, document_masking: bool,
                      where: str = "sample") -> dict[str, torch.Tensor]:
    """Tensors for one packed sample.

    input_ids: [S] token ids. indices: [n, 2] document (start, end) spans or None (one document).
    Returns input_ids [S], labels [S] (labels[i] = input_ids[i + 1], or -100 where i ends a document or the
    sample, so the labels need no further shift after CP sharding), position_ids [S] (restarting at 0 at each
    document start when document_masking, else 0..S-1) and doc_spans [n, 2]. Without document masking the
    sample is one document: doc_spans is [[0, S]] and only the last label is -100. Tokens that no span
    covers count as documents of their own.
    """
    ids = torch.from_numpy(np.asarray(input_ids).astype(np.int64))
    seq = ids.numel()
    if seq < 2:
        raise MtrainError(f"{where}: holds {seq} tokens; a training sample needs at least 2")
    bounds = [0, seq]
    if document_masking and indices is not None:
        spans = np.asarray(indices, dtype=np.int64).reshape(-1, 2)
        if spans.size and (spans.min() < 0 or spans.max() > seq or np.any(spans[:, 0] > spans[:, 1])):
            raise MtrainError(f"{where}: `indices` spans {spans.tolist()[:4]}... do not fit {seq} tokens")
        bounds.extend(spans.ravel().tolist())
    edges = torch.tensor(sorted(set(bounds)), dtype=torch.long)
    doc_spans = torch.stack([edges[:-1], edges[1:]], dim=1)
    labels = torch.empty_like(ids)
    labels[:-1] = ids[1:]
    labels[doc_spans[:, 1] - 1] = IGNORE_INDEX
    lengths = doc_spans[:, 1] - doc_spans[:, 0]
    position_ids = torch.arange(seq) - torch.repeat_interleave(doc_spans[:, 0], lengths)
    return {"input_ids": ids, "labels": labels, "position_ids": position_ids, "doc_spans": doc_spans}


class TrainingReader:
    """Iterate one data-parallel rank's share of a packed MDS dataset, epoch after epoch.

    Every rank of a CP (or TP) group passes the same dp_rank and so reads the same sample; DP ranks read
    disjoint samples (each epoch is a seeded permutation, dealt round-robin; `len(self)` = samples // dp_size
    per rank, the remainder is left out that epoch). Iterating yields the rest of the current epoch and then
    moves the cursor to the next epoch; `state_dict()` is the cursor to save with a checkpoint.
    """

    def __init__(self, path: str | os.PathLike, *, dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                 shuffle: bool = True, document_masking: bool = True):
        self.path = str(path)
        if not 0 <= dp_rank < dp_size:
            raise MtrainError(f"TrainingReader: dp_rank {dp_rank} must be in [0, dp_size={dp_size})")
        self.manifest = read_manifest(self.path)
        self.folder = MDSFolder(self.path, shard_checksums(self.manifest))
        if "input_ids" not in self.folder.columns:
            raise MtrainError(f"{self.path}: missing field `input_ids` (columns {sorted(self.folder.columns)}); "
                              "pack the data with `mtrain pack` first")
        self.num_samples = len(self.folder)
        if self.num_samples < dp_size:
            raise MtrainError(f"{self.path}: {self.num_samples} samples cannot feed dp_size {dp_size} ranks")
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle, self.document_masking = seed, shuffle, document_masking
        self.dataset_id, self.seq_len = self._identify()
        self.epoch, self.position = 0, 0

    def _identify(self) -> tuple[str, int]:
        """(dataset id, tokens per sample): from mtrain's manifest, else from index.json and sample 0."""
        if self.manifest is not None:
            return self.manifest["config_hash"], int(self.manifest["seq_len"])
        with open(os.path.join(self.path, "index.json"), "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest(), len(self.folder[0]["input_ids"])

    def __len__(self) -> int:
        return self.num_samples // self.dp_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Global sample ids this rank reads in `epoch`, in order."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        return order[self.dp_rank :: self.dp_size][: len(self)]

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """Tensors of global sample `index` (see `sample_to_tensors`)."""
        record = self.folder[int(index)]
        return sample_to_tensors(record["input_ids"], record.get("indices"),
                                 document_masking=self.document_masking, where=f"{self.path} sample {index}")

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        order = self.epoch_order(self.epoch)
        while self.position < len(order):
            item = self.sample(order[self.position])
            self.position += 1
            yield item
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """The data cursor: the next sample is `epoch_order(epoch)[position]`."""
        return {"epoch": self.epoch, "position": self.position, "dp_size": self.dp_size, "seed": self.seed,
                "shuffle": self.shuffle, "num_samples": self.num_samples, "dataset_id": self.dataset_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor from `state_dict()`; refuses one made for another dataset or DP size."""
        if state["dp_size"] != self.dp_size:
            raise MtrainError(
                f"data cursor was saved with dp_size={state['dp_size']} but this run has dp_size={self.dp_size}; "
                "each DP rank's sample order depends on it: resume with the same data-parallel size "
                "(CP and TP sizes may change)"
            )
        for key in ("dataset_id", "num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise MtrainError(
                    f"data cursor was saved for {key}={state[key]!r} but this reader has {getattr(self, key)!r} "
                    f"({self.path}); resume with the same dataset and data settings"
                )
        if not 0 <= state["position"] <= len(self):
            raise MtrainError(f"data cursor position {state['position']} is outside the epoch of {len(self)} samples")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
