"""The chat template shared by the corpus builder, the tokenizer config and serving."""

from __future__ import annotations

BOS, EOS, PAD, MASK = "<|bos|>", "<|endoftext|>", "<|pad|>", "<|mask|>"
USER, ASSISTANT, SYSTEM, END = "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"
SPECIAL_TOKENS = (EOS, BOS, PAD, MASK, USER, ASSISTANT, SYSTEM, END)

# Jinja form of `render`, for tokenizer_config.json (transformers' apply_chat_template).
JINJA_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def render(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """<|role|>\\ncontent<|end|>\\n per message, then <|assistant|>\\n when a reply is wanted."""
    out = []
    for m in messages:
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"unknown chat role {m['role']!r}")
        out.append(f"<|{m['role']}|>\n{m['content']}{END}\n")
    if add_generation_prompt:
        out.append(f"{ASSISTANT}\n")
    return "".join(out)


def parse(text: str) -> list[dict[str, str]] | None:
    """`render`'s text with its generation prompt back into messages; None for text not in that form (a
    completion prompt). What lets a prompt set written in dspark's turn format be rendered in another model's
    template (`training/eval/report.py`)."""
    suffix = f"{ASSISTANT}\n"
    if not text.endswith(suffix):
        return None
    messages, rest = [], text[: -len(suffix)]
    while rest:
        role = next((r for r in ("system", "user", "assistant") if rest.startswith(f"<|{r}|>\n")), None)
        end = rest.find(f"{END}\n")
        if role is None or end < 0:
            return None
        messages.append({"role": role, "content": rest[len(role) + 5 : end]})
        rest = rest[end + len(END) + 1 :]
    return messages or None


def qa(question: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
