"""Chat-format rows: the roles a message may have, rendering messages with the tokenizer's own chat template
(a broken or sandbox-escaping template is one line), and BOS exactly once."""

from __future__ import annotations

import difflib

from rl.errors import DataError

# The roles of the chat format (OpenAI's, which chat templates render); a typo such as "asistant" would
# otherwise be rendered as some other turn and the loss mask would silently follow it.
CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: list, where: str, col: str) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: column '{col}' message {i} must be {{\"role\": str, \"content\": str}}")
        if m["role"] not in CHAT_ROLES:
            close = difflib.get_close_matches(m["role"], CHAT_ROLES, n=1)
            raise DataError(f"{where}: column '{col}' message {i} has role {m['role']!r}; a role is one of "
                            f"{', '.join(CHAT_ROLES)}" + (f" (did you mean {close[0]!r}?)" if close else ""))


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Messages -> text with the tokenizer's own chat template (error if it has none)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("chat-format data needs a tokenizer with a chat template; this model's tokenizer "
                        "has none (use plain text columns or a chat model)")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateError family: a broken or hostile template
        if "jinja2" not in type(e).__module__:
            raise
        what = ("tried to leave the Jinja sandbox and was stopped (nothing ran)" if type(e).__name__ == "SecurityError"
                else "cannot be rendered")
        raise DataError(f"the tokenizer's chat template {what} ({type(e).__name__}: "
                        f"{(str(e).splitlines() or [''])[0][:160]}); fix chat_template in its tokenizer_config.json, "
                        f"or use plain prompts (--chat-template no, chat_template=false)") from None


def with_bos(tokenizer, ids: list[int]) -> list[int]:
    """`ids` with the tokenizer's BOS first, exactly once: a chat template may render it itself
    (ChatML's `<|im_start|>` is SmolLM2's BOS), and a second copy is a sequence the model never saw."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return list(ids) if bos is None or list(ids[:1]) == [bos] else [bos] + list(ids)
