"""Assistant-only loss masks on the REAL chat templates of the presets' targets (tests/fixtures/templates:
Qwen2.5-7B-Instruct's default system prompt, Llama-3.1-8B-Instruct's date header and trimmed contents, Qwen3's
reasoning blocks and rewritten history), rendered with tiny byte-level tokenizers carrying their special tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from data.formats import pack_ids
from data.template import conversation_ids, earlier_reasoning, prompt_ids, render, tokenize_conversation
from train.target import _build_tiny_tokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
EOT = {"qwen2.5-7b-instruct": "<|im_end|>", "qwen3-8b": "<|im_end|>", "llama-3.1-8b-instruct": "<|eot_id|>"}


def real_tokenizer(name: str):
    if name.startswith("llama"):
        tok = _build_tiny_tokenizer("llama3")
        tok.add_special_tokens({"additional_special_tokens": ["<|eom_id|>", "<|python_tag|>", "<|end_of_text|>"]})
    else:
        tok = _build_tiny_tokenizer("chatml")
        tok.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>"])   # added, not special (Qwen)
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


def U(text: str) -> dict:
    return {"role": "user", "content": text}


def A(text: str) -> dict:
    return {"role": "assistant", "content": text}


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """The masked runs [start, end) of ``mask``."""
    out, start = [], None
    for j, m in enumerate([*mask, 0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            out.append((start, j))
            start = None
    return out


def masked(tok, conv: list[dict], thinking: bool | None = None) -> list[str]:
    ids, mask = tokenize_conversation(tok, conv, thinking=thinking)
    if conv[-1].get("truncated"):   # an answer the target did not end: its prompt and its ids, nothing after
        answer = tok(conv[-1]["content"], add_special_tokens=False)["input_ids"]
        assert ids == prompt_ids(tok, conv[:-1], thinking) + answer
    else:
        assert ids == conversation_ids(tok, conv, thinking=thinking)
    return [tok.decode(ids[a:b]) for a, b in spans(mask)]


ANSWERS = ["It is 4.", "Six, of course.", "Goodbye!"]
CONVERSATIONS = {
    "no system": [U("What is 2+2?"), A(ANSWERS[0]), U("And 3+3?"), A(ANSWERS[1]), U("Bye."), A(ANSWERS[2])],
    "system": [{"role": "system", "content": "Answer briefly."}, U("What is 2+2?"), A(ANSWERS[0]), U("And 3+3?"),
               A(ANSWERS[1]), U("Bye."), A(ANSWERS[2])],
}


@pytest.mark.parametrize("system", list(CONVERSATIONS))
@pytest.mark.parametrize("name, thinking", [("qwen2.5-7b-instruct", None), ("llama-3.1-8b-instruct", None),
                                            ("qwen3-8b", None), ("qwen3-8b", False), ("qwen3-8b", True)])
def test_each_answer_and_its_end_of_turn_is_trained_and_nothing_else(name, thinking, system):
    """Three turns: exactly each answer and its end-of-turn token are trained, not the headers, the system
    prompt the template adds (Qwen2.5) or its date header (Llama 3.1); Qwen3's empty <think> block is prompt
    (thinking=false) or text the template put there (otherwise), never trained. What regeneration continued from
    is the training sequence's prefix, for every turn of a template that keeps history, the last one of Qwen3."""
    tok, conv = real_tokenizer(name), CONVERSATIONS[system]
    assert masked(tok, conv, thinking) == [a + EOT[name] for a in ANSWERS]
    whole = conversation_ids(tok, conv, thinking)
    turns = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
    for i in turns[-1:] if name == "qwen3-8b" else turns:
        before = prompt_ids(tok, conv[:i], thinking)
        assert whole[: len(before)] == before, f"turn {i}"
    if name == "qwen3-8b" and thinking is not False:   # rendered before the last answer, not trained
        assert "<|im_start|>assistant\n<think>\n\n</think>\n\nGoodbye!" in render(tok, conv, thinking=thinking)


def test_qwen3_history_answer_is_found_after_its_header():
    """An earlier Qwen3 turn (rendered as history, reasoning stripped) whose answer also occurs in its header
    ("a" in "assistant"): the answer itself is trained, not the header's letters."""
    tok = real_tokenizer("qwen3-8b")
    assert masked(tok, [U("a or b?"), A("a"), U("again"), A("b")], False) == ["a<|im_end|>", "b<|im_end|>"]
    assert masked(tok, [U("Say it"), A("assistant"), U("again"), A("b")], False) == ["assistant<|im_end|>",
                                                                                     "b<|im_end|>"]


def test_qwen3_reasoning_only_answer_keeps_its_end_of_turn():
    """An earlier answer that was all reasoning renders as nothing in history: its end of turn is trained, and
    the data stage goes on (it raised, stopping the whole run)."""
    tok = real_tokenizer("qwen3-8b")
    assert masked(tok, [U("Hi"), A("<think>\nx\n</think>\n\n"), U("?"), A("ok")], None) == ["<|im_end|>",
                                                                                              "ok<|im_end|>"]


def test_control_token_text_is_what_the_template_writes():
    """The texts a dataset's turn must not hold: the special tokens the chat template writes and BOS/EOS, not the
    special tokens it never writes (Llama-3's reserved ones, SmolLM2's <filename>) nor Qwen's added <think>."""
    from data.formats import special_text

    llama, qwen = real_tokenizer("llama-3.1-8b-instruct"), real_tokenizer("qwen3-8b")
    llama.add_special_tokens({"additional_special_tokens": ["<|reserved_special_token_3|>"]})
    qwen.add_special_tokens({"additional_special_tokens": ["<filename>"]})   # (SmolLM2's StarCoder tokens)
    pattern = special_text(llama)
    assert pattern.search("x <|eot_id|> y") and pattern.search("<|start_header_id|>assistant")
    assert pattern.search("<|begin_of_text|>hi")   # the template writes it through bos_token
    assert not pattern.search("reserved: <|reserved_special_token_3|>")
    end_of_text = llama.convert_tokens_to_ids("<|end_of_text|>")   # Llama-3.1's generation config stops at it too
    assert not pattern.search("a <|end_of_text|>") and special_text(llama, {end_of_text}).search("a <|end_of_text|>")
    assert special_text(qwen).search("hi<|im_end|>") and not special_text(qwen).search("git add <filename>")


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen2.5-7b-instruct", "llama-3.1-8b-instruct"])
def test_reasoning_the_conversation_drops_is_trained_in_a_row_of_its_own(name):
    """Qwen3 drops every earlier answer's reasoning from the conversation's render (its row trains only their final
    answers): each such answer gets a row of its own, the conversation up to it as the target wrote it, where only
    that answer (its reasoning included) and its end of turn are trained. The last answer's reasoning is in the
    conversation's row; templates that keep every answer whole (Qwen2.5, Llama 3.1) add no row."""
    tok = real_tokenizer(name)
    first, second = "<think>\nadd them\n</think>\n\nIt is 4.", "<think>\nadd again\n</think>\n\nSix."
    conv = [U("What is 2+2?"), A(first), U("And 3+3?"), A(second), U("Bye."), A("<think>\nwave\n</think>\n\nBye!")]
    rows = earlier_reasoning(tok, conv)
    if name != "qwen3-8b":
        assert rows == []
        return
    assert len(rows) == 2
    for (ids, mask), end, answer in zip(rows, (2, 4), ("add them", "add again"), strict=True):
        assert ids == conversation_ids(tok, conv[:end])   # rendered with that answer last: its reasoning in it
        prompt = prompt_ids(tok, conv[:end - 1])
        assert not any(mask[:len(prompt)]) and ids[:len(prompt)] == prompt
        (trained,) = [tok.decode(ids[a:b]) for a, b in spans(mask)]
        assert answer in trained and trained.endswith("<|im_end|>") and trained.count("<think>") == 1
    assert "add them" not in tok.decode(conversation_ids(tok, conv))   # (what the conversation's row misses)
    from data.stage import _training_rows, pool_map

    convs = [{"id": "c", "source": "s", "category": "k", "messages": conv, "split": "train"},
             {"id": "v", "source": "s", "category": "k", "messages": conv, "split": "validation"}]

    def made(max_length: int, overflow: str = "truncate") -> list[list[dict]]:
        return [rows for rows, _ in pool_map(_training_rows, convs, 1, "tokenize", tokenizer=tok,
                                             max_length=max_length, overflow=overflow)]

    train, validation = made(4096)
    assert [r["id"] for r in train] == ["c", "c#1", "c#2"] and [r["id"] for r in validation] == ["v"]   # (its cap)
    assert [r["input_ids"].tolist() for r in train[1:]] == [ids for ids, _ in rows]
    assert len({r["key"] for r in train}) == 1   # the conversation's (its kept states cover none of the new rows)
    # overflow=drop cuts the conversation back to its first answer, which its row then ends with, reasoning
    # included: no second row of that answer
    train, _ = made(len(rows[0][0]) + 1, "drop")
    assert [r["id"] for r in train] == ["c"] and train[0]["input_ids"].tolist() == rows[0][0]
    train, _ = made(len(rows[1][0]), "drop")   # cut back to the second answer: the first's reasoning has its row
    assert [r["id"] for r in train] == ["c", "c#1"] and train[0]["input_ids"].tolist() == rows[1][0]


def test_qwen3_truncated_reasoning_is_trained_without_the_block_the_template_adds():
    """A last answer cut inside its reasoning (no </think>) gets an empty <think> block put before it by the
    template; the target wrote none, so it is not trained on: the answer is."""
    tok = real_tokenizer("qwen3-8b")
    conv = [U("Prove it"), A("<think>\nLet me think")]
    assert "assistant\n<think>\n\n</think>\n\n<think>\nLet me think" in render(tok, conv)
    assert masked(tok, conv) == ["<think>\nLet me think<|im_end|>"]
    # regenerated, it is cut at max_new_tokens: the target wrote it right after the generation prompt, and that is
    # the row (no empty block before it, no end of turn after it)
    assert masked(tok, [*conv[:-1], {**conv[-1], "truncated": True}]) == ["<think>\nLet me think"]


@pytest.mark.parametrize("name, thinking", [("qwen2.5-7b-instruct", None), ("llama-3.1-8b-instruct", None),
                                            ("qwen3-8b", False), ("qwen3-8b", None)])
def test_an_answer_the_target_did_not_end_trains_no_end_of_turn(name, thinking):
    """An answer cut at data.regen.max_new_tokens (regeneration marks it truncated) gets the template's end of turn
    after it, which the target never wrote: it is context, not trained (an earlier turn, rendered as history in
    Qwen3, and the last one); the answers the target ended keep theirs."""
    tok = real_tokenizer(name)
    conv = [U("Tell me a story."), {**A("Once upon a"), "truncated": True}, U("And then?"), A("The end."),
            U("Again?"), {**A("Once more upon"), "truncated": True}]
    assert masked(tok, conv, thinking) == ["Once upon a", f"The end.{EOT[name]}", "Once more upon"]
    ids, _ = tokenize_conversation(tok, conv, thinking)
    assert tok.decode(ids).count(EOT[name]) >= 3   # still in the sequence, as the target saw it in later turns


@pytest.mark.parametrize("answer", ["e", "d", "end", ">"])
def test_qwen3_short_answer_is_found_after_the_injected_block(answer):
    """A last answer short enough to occur in the end of turn after it (<|im_end|>) is located where the answer
    starts, after the empty <think> block the template puts before it."""
    assert masked(real_tokenizer("qwen3-8b"), [U("Say it"), A(answer)]) == [f"{answer}<|im_end|>"]


def test_qwen3_answer_starting_with_a_newline_is_found_after_the_injected_block():
    """The template strips a last answer's leading newlines after the empty <think> block it puts before it (a
    dataset answer "\\nHello"): the block stays prompt, the answer and its end of turn are trained."""
    assert masked(real_tokenizer("qwen3-8b"), [U("hi"), A("\nHello")]) == ["Hello<|im_end|>"]


@pytest.mark.parametrize("name, thinking", [("qwen2.5-7b-instruct", None), ("llama-3.1-8b-instruct", None),
                                            ("qwen3-8b", False), ("qwen3-8b", True)])
@pytest.mark.parametrize("truncated", [False, True])
def test_a_last_answer_trains_on_the_ids_the_target_generated(name, thinking, truncated):
    """A regenerated last answer whose text tokenises to other ids than the target generated (here an incomplete
    UTF-8 character; with real BPE vocabularies merges the target did not take) is trained as generated: the
    states kept while regenerating belong to those ids. The tokens around it and their mask are the text's; an
    earlier answer's ids stay as its text (the later prompts rendered it so)."""
    tok = real_tokenizer(name)

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    reasoning = "<think>\nok\n</think>\n\n" if thinking else ""   # a reasoning answer: what the target wrote
    generated = encode(reasoning) + encode("€")[:2] + encode(" fine")
    content = tok.decode(generated, skip_special_tokens=True)
    text = encode(content)
    assert text != generated and "\ufffd" in content
    history = [U("Hi"), {**A("Hello"), "token_ids": pack_ids(encode("Hel") + encode("€")[:1])}, U("And you?")]
    plain = {**A(content), **({"truncated": True} if truncated else {})}
    ids, mask = tokenize_conversation(tok, [*history, plain], thinking)
    got_ids, got_mask = tokenize_conversation(tok, [*history, {**plain, "token_ids": pack_ids(generated)}], thinking)
    start = len(prompt_ids(tok, history, thinking))
    end = start + len(text)
    assert ids[start:end] == text and set(mask[start:end]) == {1}
    assert got_ids == [*ids[:start], *generated, *ids[end:]]
    assert got_mask == [*mask[:start], *[1] * len(generated), *mask[end:]]
    after = start + len(generated)   # the end of turn, trained, after an answer the target ended; none after a cut one
    assert (tok.decode(got_ids[after:]).count(EOT[name]), sum(got_mask[after:])) == ((0, 0) if truncated else (1, 1))
    # ids that render as the text: nothing to change
    assert tokenize_conversation(tok, [*history, {**plain, "token_ids": pack_ids(text)}], thinking) == (ids, mask)


def test_generated_ids_the_template_does_not_render_verbatim_stay_as_text():
    """Llama 3.1 trims answers: an answer generated with a leading space is not verbatim after the prompt, so its
    text's tokens stay (its states then come from the extract pass)."""
    tok = real_tokenizer("llama-3.1-8b-instruct")
    generated = tok(" Sure.", add_special_tokens=False)["input_ids"]
    conv = [U("Hi"), A(" Sure.")]
    assert tokenize_conversation(tok, [*conv[:1], {**conv[1], "token_ids": pack_ids(generated)}]) == tokenize_conversation(tok, conv)
