"""Chat templates that reproduce how real targets render conversations, for the character-level
test tokenizer (tests/conftest.py `make_tokenizer`). It has no Llama specials, so every template
uses its ChatML ones (<s>, <|im_start|>, <|im_end|>) for headers and turn ends.

transformers renders templates with trim_blocks, which drops a newline right after a `{% ... %}`
tag; newlines there are written as `{{ '\\n' }}`.
"""

# Qwen3: an empty <think>\n\n</think>\n\n block before the content of the last assistant turn only.
QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2.5: a default system prompt ("You are Qwen, created by Alibaba Cloud...") when the
# conversation has none.
QWEN25_LIKE = (
    "{% if not messages or messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Llama-3.1: BOS, then a system header always, opening with 'Cutting Knowledge Date' and 'Today
# Date' lines (the conversation's system message, if any, after them); contents trimmed.
LLAMA31_LIKE = (
    "{{ bos_token }}<|im_start|>system\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] | trim }}{% endif %}<|im_end|>"
    "{% for m in messages %}{% if m['role'] != 'system' %}"
    "<|im_start|>{{ m['role'] }}\n\n{{ m['content'] | trim }}<|im_end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n\n{% endif %}"
)

# QWEN3_LIKE with {% generation %} markers around each assistant content and its <|im_end|>, as
# templates written for assistant-only training have them; the empty think block stays outside:
# with Qwen3's enable_thinking=False it is part of the prompt, not of what the model generates.
GENERATION_MARKED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}"
    "{% if loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Gemma-3: BOS, then `<start_of_turn>` + role + newline per turn, the assistant's role written
# `model`, and `<end_of_turn>` + newline after each; contents trimmed. It has no system role: a
# system message is prepended to the first user turn, followed by a blank line. <|im_start|> and
# <|im_end|> stand in for <start_of_turn> and <end_of_turn>.
GEMMA3_LIKE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] | trim ~ '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}<|im_start|>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ prefix if loop.first else '' }}{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>model\n{% endif %}"
)
