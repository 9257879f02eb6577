"""Token sequences of different lengths, batched by Hugging Face's own padding collator.

``DataCollatorForLanguageModeling(mlm=False)`` pads each batch to its own longest sequence
(so the batch's row shape changes from one step to the next), and returns ``input_ids``,
``attention_mask`` and ``labels`` (the ids, -100 at the padding), the dict a causal LM takes
as ``model(**batch)``. The tokenizer is a word-level one built in code over the tiny models'
vocabulary (tests/real_models.py): token ``t0`` (id 0) pads, nothing is downloaded.
"""
import torch

from tests.real_models import VOCAB


def padding_collator():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)},
                                                                             unk_token="t1")), pad_token="t0")
    return DataCollatorForLanguageModeling(tokenizer, mlm=False, return_tensors="pt")


def padded_batches(longest, rows=4, seed=0):
    """One collated batch per entry of ``longest`` (its padded length): ``rows`` sequences of
    random lengths in [3, longest], the first of length ``longest``, of ids 1..VOCAB-1."""
    g = torch.Generator().manual_seed(seed)
    collate = padding_collator()
    out = []
    for length in longest:
        lengths = [length] + torch.randint(3, length + 1, (rows - 1,), generator=g).tolist()
        out.append(collate([{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in lengths]))
    return out


def hf_loss(model, batch):
    """Hugging Face's causal-LM loss: the mean over the batch's non-padding label tokens."""
    return model(**batch).loss
