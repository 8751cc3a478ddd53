"""llguidance's view of a Hugging Face tokenizer: the front compiles grammars over it, the
worker's matchers fill token masks with it."""

from __future__ import annotations

from typing import Any, Sequence


def structured_output_supported(hf_tokenizer: Any) -> bool:
    """Whether llguidance can wrap this tokenizer (fast Hugging Face ones only): start-up
    builds nothing for one it can't, and a constrained request then gets the 400."""
    from transformers import PreTrainedTokenizerFast

    return isinstance(hf_tokenizer, PreTrainedTokenizerFast)


def ll_tokenizer(hf_tokenizer: Any, eos_token_ids: Sequence[int]) -> Any:
    """llguidance's view of a Hugging Face fast tokenizer. Its EOS ids are the ones the
    scheduler stops on, so a finished grammar's mask allows exactly the tokens that end
    the request."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=list(eos_token_ids) or None)
