"""The embedded character-level tokenizer: one token per character, plus pad/bos/eos/unk.

Built with ``tokenizers`` (a BPE model with no merges splits text into characters) and wrapped
in a ``PreTrainedTokenizerFast``, so it saves and loads like any HF tokenizer. Encoding adds
``<bos>`` in front (as Llama tokenizers do); ``<eos>`` ends every completion.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = " +-=.0123456789\\{}Cabdemoptux"  # every character the embedded task writes


def build_tokenizer(chars: str = CHARS) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
