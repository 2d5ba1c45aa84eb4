"""Chat-template rendering with assistant-only loss masks.

The conversation is rendered once with the TARGET's own chat template and tokenized with character
offsets. For each assistant turn i, rendering the messages before it with ``add_generation_prompt``
gives where its content starts, and rendering up to and including it gives where the turn ends. The
mask covers the tokens in between -- the content and the end-of-turn token, not the header -- and
stops after the last special token of that span (so formatting newlines after ``<|im_end|>`` are not
trained on).
"""

from __future__ import annotations

from data.formats import DataError


def with_system(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """Replace (or add) the system turn when ``system_prompt`` is set."""
    if not system_prompt:
        return messages
    return [{"role": "system", "content": system_prompt}] + [m for m in messages if m["role"] != "system"]


def check_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template. Use the instruct/chat variant of the "
            "target, or set one (tokenizer.chat_template) in the target's directory."
        )


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` followed by the assistant header (what generation continues)."""
    return tokenizer(render(tokenizer, messages, True), add_special_tokens=False)["input_ids"]


def tokenize_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) with loss_mask = 1 exactly on assistant tokens (incl. end of turn)."""
    text = render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1])
        if not text.startswith(before) or not text.startswith(upto):
            raise DataError(
                "the chat template does not render conversations prefix-consistently (turn "
                f"{i}); assistant masks cannot be derived for it"
            )
        spans.append((len(before), len(upto)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)
    }
    mask = [0] * len(ids)
    for start, end in spans:
        inside = [j for j, (a, b) in enumerate(offsets) if start <= a < end and b > a]
        ends = [j for j in inside if ids[j] in special]
        if ends:
            inside = [j for j in inside if j <= ends[-1]]
        for j in inside:
            mask[j] = 1
    return ids, mask
