"""Model directories for the agent API tests: demo-tiny's weights and tokenizer with a
chat template of one family that takes tools (written here, after the families' own).

The random model never calls a tool of itself; under tool_choice "required" or a named
function the grammar writes the family's markup, which the front must parse back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

HERMES = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- set tool_call = tool_call.function if tool_call.function is defined else tool_call %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Hermes calls with DeepSeek-R1's habits: past answers lose their reasoning, and the
# prompt opens the reasoning block.
THINKING = HERMES.replace(
    "{% if message.content %}{{ message.content }}{% endif %}",
    "{% if message.content %}{{ message.content.split('</think>')[-1] }}{% endif %}").replace(
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")

LLAMA3 = """\
{{- bos_token }}<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
Respond in the format {"name": function name, "parameters": dictionary of argument name \
and its value}. Do not use variables.

{% for t in tools %}{{ t | tojson }}

{% endfor %}{% endif %}{% if messages[0].role == 'system' %}{{ messages[0].content }}\
{% endif %}<|eot_id|>
{%- for message in messages %}{% if message.role != 'system' %}
{%- if message.role == 'assistant' and message.tool_calls %}\
<|start_header_id|>assistant<|end_header_id|>

{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": \
{{ tc.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """\
{{- bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS][\
{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "arguments": \
{{ tc.function.arguments | tojson }}, "id": "{{ tc.id }}"}{% if not loop.last %}, {% endif %}\
{% endfor %}]{{ eos_token }}
{%- elif message.role == 'assistant' %}{{ message.content }}{{ eos_token }}
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{"content": {{ message.content | tojson }}, \
"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- endif %}{% endfor %}"""

HARMONY = """\
<|start|>system<|message|>You are a helpful assistant.
Reasoning: medium
# Valid channels: analysis, commentary, final.<|end|>
{%- if tools %}<|start|>developer<|message|># Tools

## functions

namespace functions {
{% for t in tools %}type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) \
=> any;
{% endfor %}} // namespace functions<|end|>{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}{% for tc in message.tool_calls %}\
<|start|>assistant<|channel|>commentary to=functions.{{ tc.function.name }} \
<|constrain|>json<|message|>{{ tc.function.arguments | tojson }}<|call|>{% endfor %}
{%- elif message.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>\
{{ message.content }}<|end|>
{%- elif message.role == 'tool' %}<|start|>functions.{{ message.name }} to=assistant\
<|channel|>commentary<|message|>{{ message.content | tojson }}<|end|>
{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

TEMPLATES = {"hermes": HERMES, "thinking": THINKING, "llama3": LLAMA3, "mistral": MISTRAL,
             "harmony": HARMONY}


def family_model(base: Path, root: Path, family: str) -> Path:
    """A copy of the model at `base` whose chat template is the family's (weights are
    linked, not copied)."""
    target = root / f"demo-tiny-{family}"
    if target.exists():
        return target
    target.mkdir(parents=True)
    for item in base.iterdir():
        if item.suffix == ".safetensors":
            (target / item.name).symlink_to(item.resolve())
        elif item.is_file():
            shutil.copy(item, target / item.name)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATES[family]
    config_path.write_text(json.dumps(config))
    return target
