"""Text for a causal LM: a local text or JSONL file, tokenised with the model's own tokenizer,
cut into a training and a held-out split, and served as padded global batches.

Nothing here knows about zeroray; examples/finetune_hf.py puts it together with a Trainer.

[Note: the loss of a padded batch]
A padded batch holds rows of different lengths; the loss a Hugging Face user expects is the mean
over the batch's real (non-padding) label tokens, as a causal LM's ``model(**batch).loss``
computes it on one process. zeroray's global loss is the mean of the workers' losses (DDP's rule,
README "The loss is DDP's"), each computed on the worker's rows: with ``model(**batch).loss`` that
is the mean of per-worker token means, which weighs a worker's tokens by how many its rows hold,
and so changes with the number of workers. Hugging Face's Trainer meets the same problem with
gradient accumulation, and answers it the same way as here: it divides the summed token losses
by the number of label tokens in the whole batch (``num_items_in_batch``). The collator writes
the global batch's label-token count ``num_tokens`` and row count ``num_rows`` into every row, so
each worker's share carries them; ``loss_fn`` returns its rows' summed token losses over
``num_tokens``, times ``num_rows`` over its own rows. The mean over W workers of equal shares
(``num_rows / rows = W``) is then the sum of all token losses over ``num_tokens``: the per-token
mean of the whole batch, the single-process loss, at any number of workers. That is what lets a
run resumed at another worker count go on as one uninterrupted run (tests/e2e/test_finetune_hf.py
checks it against single-process PyTorch). The factor ``num_rows / rows`` rather than the world
size keeps this true when a batch is split over the workers in unequal shares whose losses are
weighed by their rows.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Iterator, List, Sequence, Tuple

import torch
import torch.nn.functional as F


class InputError(ValueError):
    """Input the job cannot use (a missing file, a file that is not text or JSONL, a model that is
    not a causal LM); the command line prints its message, without a traceback."""


# --- reading ---------------------------------------------------------------------------------------


def read_texts(path: str, text_field: str = "text") -> List[str]:
    """The documents of ``path``: for ``.jsonl`` (or ``.json`` lines), the ``text_field`` string of
    each line's JSON object; for any other file, UTF-8 text cut at blank lines (one paragraph a
    document). Empty documents are dropped."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file: give a UTF-8 text file (documents separated by blank lines) "
                         f"or a JSONL file (one {{\"{text_field}\": ...}} object a line)")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not UTF-8 text (byte {e.start} cannot be decoded): give a text file, or a JSONL "
                         f"file of {{\"{text_field}\": ...}} objects") from None
    if "\x00" in text:
        raise InputError(f"{path} holds NUL bytes, so it is a binary file, not text: give a text file or a JSONL file")
    if path.endswith((".jsonl", ".json")):
        docs = _jsonl_texts(path, text, text_field)
    else:
        docs = [" ".join(block.split()) for block in text.replace("\r\n", "\n").split("\n\n")]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise InputError(f"{path} holds no text")
    return docs


def _jsonl_texts(path: str, text: str, field: str) -> List[str]:
    docs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path} is not JSONL: line {number} is not JSON ({e.msg}); each line must be one object "
                             f"like {{\"{field}\": \"...\"}}, or give a plain text file without the .jsonl suffix") from None
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            got = f"keys {sorted(record)}" if isinstance(record, dict) else type(record).__name__
            raise InputError(f"{path}, line {number}: expected an object with a string field {field!r}, got {got}; "
                             "pass --text-field NAME for another field")
        docs.append(record[field])
    return docs


# --- tokens ----------------------------------------------------------------------------------------


def tokenize(tokenizer, docs: Sequence[str], max_length: int) -> List[List[int]]:
    """Each document as the model's tokenizer encodes it (its own special tokens, e.g. a start
    token), ending with the end-of-text token, cut into pieces of at most ``max_length`` tokens
    (nothing dropped but pieces too short to predict anything)."""
    eos = tokenizer.eos_token_id
    out = []
    for ids in tokenizer(list(docs))["input_ids"]:
        if eos is not None and (not ids or ids[-1] != eos):
            ids = ids + [eos]
        out.extend(ids[i:i + max_length] for i in range(0, len(ids), max_length))
    return [ids for ids in out if len(ids) >= 2]


def split(docs: Sequence[str], eval_fraction: float, seed: int) -> Tuple[List[str], List[str]]:
    """(training, held-out) documents: a seeded shuffle, whole documents on each side, so that no
    held-out text was trained on."""
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = max(1, round(len(docs) * eval_fraction)) if eval_fraction > 0 else 0
    return [docs[i] for i in order[n_eval:]], [docs[i] for i in order[:n_eval]]


def collate(rows: Sequence[Sequence[int]], pad_id: int) -> Dict[str, torch.Tensor]:
    """A batch padded on the right to its own longest row: ``input_ids``, ``attention_mask``,
    ``labels`` (the ids, -100 on padding), and in every row the batch's ``num_tokens`` (label
    tokens a causal LM predicts: each row's length less one) and ``num_rows`` ([Note: the loss of a
    padded batch]). Padding is found by the mask, not by the pad id, so a tokenizer that pads with
    its end-of-text token still learns to end a text."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    n_tokens = sum(len(r) - 1 for r in rows)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100),
            "num_tokens": torch.full((len(rows),), n_tokens, dtype=torch.long),
            "num_rows": torch.full((len(rows),), len(rows), dtype=torch.long)}


class Batches:
    """Re-iterable global batches for ``steps`` steps: each epoch a seeded shuffle of ``rows``, cut
    into batches of ``batch_size`` (an epoch's remainder goes to the next), the same batches for the
    same arguments, so a resumed run skips exactly what it had consumed."""

    def __init__(self, rows: Sequence[Sequence[int]], batch_size: int, steps: int, pad_id: int, seed: int) -> None:
        if len(rows) < batch_size:
            raise InputError(f"the training split has {len(rows)} sequences, fewer than one batch of {batch_size}: "
                             "give more text, or a smaller --batch-size")
        self.rows, self.batch_size, self.steps, self.pad_id, self.seed = list(rows), batch_size, steps, pad_id, seed

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        order: List[int] = []
        epoch = 0
        for _ in range(self.steps):
            while len(order) < self.batch_size:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                order += torch.randperm(len(self.rows), generator=g).tolist()
                epoch += 1
            take, order = order[:self.batch_size], order[self.batch_size:]
            yield collate([self.rows[i] for i in take], self.pad_id)


def eval_batches(rows: Sequence[Sequence[int]], batch_size: int, pad_id: int) -> List[Dict[str, torch.Tensor]]:
    """The held-out rows in order, in batches of ``batch_size``; a last partial batch is left out
    (a batch splits evenly over the workers)."""
    usable = len(rows) // batch_size * batch_size
    if usable == 0:
        raise InputError(f"the held-out split has {len(rows)} sequences, fewer than one batch of {batch_size}: "
                         "raise --eval-fraction, or give more text")
    return [collate(rows[i:i + batch_size], pad_id) for i in range(0, usable, batch_size)]


# --- the loss --------------------------------------------------------------------------------------


def token_nll(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sum of the next-token losses over the rows' label tokens, how many there are), in fp32."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    nll = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return nll, (labels != -100).sum()


def loss_fn(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """This share's part of the global batch's per-token mean loss ([Note: the loss of a padded batch])."""
    nll, _ = token_nll(model, batch)
    return nll / batch["num_tokens"][0] * (batch["num_rows"][0] / batch["input_ids"].shape[0])


def metric_fn(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The summed token loss and the token count of this share. evaluate averages each over the
    workers, then over the batches, with the same weights for both, so their ratio is the held-out
    split's per-token loss, whose exp is its perplexity."""
    nll, count = token_nll(model, batch)
    return {"nll": nll, "tokens": count.float()}
