"""SFT samples: alpaca / sharegpt / openai-messages records → token ids + a loss mask on assistant tokens."""

from __future__ import annotations

from typing import Any

from loongforge.errors import RecipeError

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def detect_style(record: dict[str, Any]) -> str:
    if "messages" in record:
        return "openai"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    raise RecipeError(f"cannot tell the SFT format of a record with keys {sorted(record)}; set data.sft_style", key="data.sft_style")


def to_messages(record: dict[str, Any], style: str) -> list[dict[str, str]]:
    """Normalise one record to a list of ``{"role", "content"}`` messages."""
    style = detect_style(record) if style == "auto" else style
    try:
        if style == "openai":
            return [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
        if style == "sharegpt":
            return [{"role": _SHAREGPT_ROLES[m["from"]], "content": m["value"]} for m in record["conversations"]]
        prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    except (KeyError, TypeError) as exc:
        raise RecipeError(f"record does not match SFT style '{style}': missing {exc}", key="data.sft_style") from None


def tokenize_conversation(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of the chat-templated conversation and a 0/1 mask that is 1 on assistant tokens only.

    Each assistant turn's tokens are found as the difference between the template rendered up to the turn
    (with the generation prompt) and rendered through it, so the mask follows the tokenizer's own template.
    """

    def render(msgs: list[dict[str, str]], gen: bool) -> list[int]:
        out = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    ids = render(messages, False)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(render(messages[:i], True))
        end = len(render(messages[: i + 1], False))
        for t in range(start, min(end, len(ids))):
            mask[t] = 1
    return ids, mask


def sft_sample(tokenizer, record: dict[str, Any], *, style: str, origin: str) -> tuple[list[int], list[int]]:
    """Token ids and assistant mask of one record; any problem is one ``RecipeError`` naming ``origin``
    (``file:line``)."""
    try:
        messages = to_messages(record, style)
        for m in messages:
            if not isinstance(m["content"], str) or not isinstance(m["role"], str):
                raise RecipeError(f"message contents and roles must be strings, got {type(m['content']).__name__} "
                                  f"for role {m['role']!r}", key="data.sft_style")
        return tokenize_conversation(tokenizer, messages)
    except RecipeError as exc:
        raise RecipeError(f"{origin}: {exc.message}", key=exc.key) from None
    except Exception as exc:  # noqa: BLE001 - the tokenizer's chat template refused the conversation
        detail = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise RecipeError(f"{origin}: the chat template failed ({detail})", key="data.source.paths") from None
