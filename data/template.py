"""Chat-template rendering with assistant-only loss masks.

The conversation is rendered once with the TARGET's own chat template and tokenized with character
offsets. For each assistant turn i, rendering the messages before it with ``add_generation_prompt``
gives where its content starts, and rendering up to and including it gives where the turn ends. The
mask covers the tokens in between -- the content and the end-of-turn token, not the header -- and
stops after the last special token of that span (so formatting newlines after ``<|im_end|>`` are not
trained on).

Reasoning templates (Qwen3: ``enable_thinking``, ``<think>...</think>`` in assistant turns). ONE
setting, ``data.thinking`` (``set_thinking``; ``null`` = the template's own default, nothing passed),
is passed as ``enable_thinking`` to every render here, so regeneration (``prompt_ids``), the training
sequences (``tokenize_conversation``) and evaluation prompts (``prompt_ids``) agree:
- ``thinking=true``: the generation prompt ends at the assistant header, the target writes
  ``<think>reasoning</think>answer`` and the mask covers all of it (reasoning is trained on);
- ``thinking=false``: the template's empty ``<think>\\n\\n</think>\\n\\n`` block ends the generation
  prompt, so it is prompt, not trained on; the mask covers the answer and the end-of-turn token.
Such templates rewrite history (earlier assistant turns lose their ``<think>`` block), so a render up
to an earlier turn is not a prefix of the whole conversation. For those turns the mask covers the
turn's final answer as the template renders it in the conversation (an answer that was all reasoning leaves its
end-of-turn token) and the end-of-turn token after it; the reasoning the render drops is trained in a row of its
own per such answer (:func:`earlier_reasoning`: the conversation up to it, as the target wrote it). Text the template injects before an answer
(Qwen3's empty ``<think>`` block before a last answer that has none) is not trained on; a last answer the
target did not end (regeneration's ``truncated``: a reasoning cut at ``max_new_tokens``) is not rendered at all,
the row is its prompt and its ids (:func:`as_generated`).

Checked against the real templates of Qwen2.5-7B-Instruct, Qwen3-8B and Llama-3.1-8B-Instruct
(``tests/fixtures/templates``). A regenerated LAST answer with its ``token_ids`` is spliced in as the target
generated it (:func:`as_generated`); every other answer is its text tokenised. Known limits: Llama 3.1 trims
answers (their leading and trailing whitespace is not trained); the sequence is otherwise the rendered text
tokenized once, so a real BPE vocabulary can merge an answer's first characters with the header's last ones
(e.g. two newlines) into one token that is then not trained on; Qwen3 with ``thinking=false`` generated each earlier turn after an empty ``<think>`` block
that the conversation's render drops from history, so those answers train on a context a little different from
the one they were generated in (the last turn's is exact).
"""

from __future__ import annotations

from data.formats import DataError, unpack_ids

SENTINEL = "SPECHEADS-SENTINEL-7f3a"
_THINKING: bool | None = None


def set_thinking(value: bool | None) -> None:
    """The process-wide ``enable_thinking`` (``data.thinking``) for renders that do not pass one."""
    global _THINKING
    _THINKING = None if value is None else bool(value)


def template_kwargs(thinking: bool | None = None) -> dict:
    """Extra template variables: ``enable_thinking`` unless thinking (or the process default) is None."""
    thinking = _THINKING if thinking is None else thinking
    return {} if thinking is None else {"enable_thinking": bool(thinking)}


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


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False, thinking: bool | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs(thinking))


def prompt_ids(tokenizer, messages: list[dict], thinking: bool | None = None) -> list[int]:
    """Token ids of ``messages`` followed by the assistant header (what generation continues)."""
    return tokenizer(render(tokenizer, messages, True, thinking), add_special_tokens=False)["input_ids"]


def conversation_ids(tokenizer, messages: list[dict], thinking: bool | None = None) -> list[int]:
    """Token ids of the whole rendered conversation (the input_ids of :func:`tokenize_conversation`)."""
    return tokenizer(render(tokenizer, messages, thinking=thinking), add_special_tokens=False)["input_ids"]


def user_turn_prefix(tokenizer, system: str | None = None, thinking: bool | None = None) -> tuple[str, str]:
    """(text up to where a user turn's content starts, text right after its content) -- the template
    rendered with a sentinel user message and cut around it. ``system`` replaces the system turn
    (None: the template's default one, if any)."""
    messages = with_system([{"role": "user", "content": SENTINEL}], system)
    text = render(tokenizer, messages, False, thinking)
    at = text.find(SENTINEL)
    if at < 0:
        raise DataError("the chat template does not render the user message verbatim; cannot find where a "
                        "user turn starts")
    return text[:at], text[at + len(SENTINEL):]


def final_answer(content: str) -> str:
    """The part of an assistant message after its reasoning (what history renders keep)."""
    return content.split("</think>")[-1].lstrip("\n") if "</think>" in content else content


def earlier_reasoning(tokenizer, messages: list[dict], thinking: bool | None = None) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) per answer whose reasoning the conversation's render drops (Qwen3 keeps ``<think>`` only in the
    last answer): the conversation up to that answer, rendered with it last (as the target wrote it, reasoning
    included), only that answer and its end of turn trained. Regeneration wrote that reasoning (most of a reasoning
    target's tokens) and the conversation's row cannot train it: without these rows a conversation of k answers
    trained the reasoning of its last one only."""
    text, out = None, []
    for i, m in enumerate(messages):
        reasoning = m["content"].split("</think>")[0].split("<think>")[-1].strip() if m["role"] == "assistant" and \
            "</think>" in m["content"] else ""
        if not reasoning:
            continue
        text = render(tokenizer, messages, thinking=thinking) if text is None else text
        if reasoning in text:   # rendered: trained in the conversation's row
            continue
        prompt = prompt_ids(tokenizer, messages[:i], thinking)
        ids, mask = tokenize_conversation(tokenizer, messages[:i + 1], thinking)
        if ids[:len(prompt)] == prompt and any(mask[len(prompt):]):
            out.append((ids, [0] * len(prompt) + mask[len(prompt):]))
    return out


def tokenize_conversation(tokenizer, messages: list[dict], thinking: bool | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) with loss_mask = 1 exactly on assistant tokens (incl. end of turn, but not after an
    answer marked ``truncated``); a last answer with ``token_ids`` as the target generated it (:func:`as_generated`)."""
    text = render(tokenizer, messages, thinking=thinking)
    # (start, end, eot_after, cut): eot_after -> also the first special token at/after end; cut -> an answer the
    # target did not end (regeneration's "truncated"): the end of turn after it is the template's, not trained
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True, thinking=thinking)
        upto = render(tokenizer, messages[: i + 1], thinking=thinking)
        if text.startswith(before) and text.startswith(upto):
            # Text the template puts between the generation prompt and the answer (Qwen3's empty <think> block
            # before a last answer without one: a truncated reasoning, a dataset answer) is not the target's.
            inner, content, start = upto[len(before):], m["content"], len(before)
            if content and not inner.startswith(content):   # where an answer starts in this position: after it
                probe = render(tokenizer, [*messages[:i], {"role": "assistant", "content": SENTINEL}], thinking=thinking)
                injected = probe.find(SENTINEL, len(before)) - len(before) if probe.startswith(before) else -1
                if injected > 0 and (inner.startswith(content, injected)   # (Qwen3 strips an answer's leading
                                     or inner.startswith(content.lstrip("\n"), injected)):   # newlines after it)
                    start += injected
            spans.append((start, len(upto), False, bool(m.get("truncated"))))
            continue
        # A template that rewrites history (reasoning stripped from earlier turns): the turn's answer as history
        # renders it, where an answer rendered as history starts (after its header, not inside it).
        history = render(tokenizer, messages[:i], thinking=thinking) if i else ""
        probe = render(tokenizer, [*messages[:i], {"role": "assistant", "content": SENTINEL},
                                   {"role": "user", "content": SENTINEL}], thinking=thinking)
        start, answer = probe.find(SENTINEL), final_answer(m["content"])
        if not (text.startswith(history) and probe.startswith(history) and start >= len(history)
                and text.startswith(answer, start)):
            raise DataError(
                "the chat template does not render conversations prefix-consistently (turn "
                f"{i}); assistant masks cannot be derived for it"
            )
        spans.append((start, start + len(answer), True, bool(m.get("truncated"))))  # all reasoning: its end of turn
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)
    }
    mask = [0] * len(ids)
    for start, end, eot_after, cut in spans:
        inside = [j for j, (a, b) in enumerate(offsets) if start <= a < end and b > a]
        if eot_after:
            inside += [] if cut else [j for j, (a, b) in enumerate(offsets) if a >= end and b > a and ids[j] in special][:1]
        else:
            ends = [j for j in inside if ids[j] in special]
            if ends:
                inside = [j for j in inside if j < ends[0]] if cut else [j for j in inside if j <= ends[-1]]
        for j in inside:
            mask[j] = 1
    return as_generated(tokenizer, messages, ids, mask, thinking)


def as_generated(tokenizer, messages: list[dict], ids: list[int], mask: list[int] | None = None,
                 thinking: bool | None = None, prompt: list[int] | None = None) -> tuple[list[int], list[int] | None]:
    """(ids, mask) of a rendered conversation with its last answer's tokens as the target generated them.

    A regenerated answer whose text tokenises to other ids than the target generated keeps them as ``token_ids``
    (:func:`data.regenerate.assistant_message`; 5% of the default target's 256-token answers: ``"\\n\\n"`` as
    one token where the text's tokenisation makes two, BPE merges the target did not take, more of longer ones).
    The generated ids are what the target conditions on when it decodes, and the states kept while regenerating
    belong to them, so they replace the text's tokens of that answer, all trained (the answer is the target's);
    the tokens around it keep the text's mask. Unchanged when the last message has no ``token_ids``, already
    renders as them, or the template does not render its text verbatim right after the generation prompt
    (``prompt``: its ids, when known; e.g. Llama 3.1 trims answers). A last answer the target did not end
    (``truncated``) is the prompt and the answer's ids, nothing after them: the end of turn the template adds is not
    the target's, and Qwen3 renders a reasoning cut before its ``</think>`` after an empty ``<think>`` block of its
    own, a context the target never saw. The decision does not depend on ``mask``, so regeneration (which keeps the
    states of the ids this returns) and the data stage agree."""
    last = messages[-1] if messages else {}
    generated = unpack_ids(last.get("token_ids"))
    if last.get("role") != "assistant" or not (generated or last.get("truncated")):
        return ids, mask
    prompt = prompt_ids(tokenizer, messages[:-1], thinking) if prompt is None else prompt
    start = len(prompt)
    if ids[:start] != prompt:
        return ids, mask
    text = tokenizer(last["content"], add_special_tokens=False)["input_ids"]
    if last.get("truncated"):   # cut: the prompt and the answer's ids are all the target saw
        if not generated or tokenizer.decode(generated, skip_special_tokens=True) != last["content"]:
            generated = text
        return [*prompt, *generated], None if mask is None else [*mask[:start], *[1] * len(generated)]
    if ids[start:start + len(generated)] == generated:
        return ids, mask
    end = start + len(text)
    if not text or ids[start:end] != text or tokenizer.decode(generated, skip_special_tokens=True) != last["content"]:
        return ids, mask
    ids = [*ids[:start], *generated, *ids[end:]]
    return ids, None if mask is None else [*mask[:start], *[1] * len(generated), *mask[end:]]
