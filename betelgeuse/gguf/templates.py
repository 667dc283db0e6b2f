"""Chat templates that synthetic models can carry (`SynthSpec.chat_template` / `DS4Spec.chat_template` name one), so
that tests exercise the real families' prompt formats and output dialects (betelgeuse.reasoning):

- "default": the small Qwen3-style ChatML of `DEFAULT` (tools, tool responses, enable_thinking=false).
- "qwen3": Qwen3's template, written here to render what Qwen3's own tokenizer_config template renders: the
  `<tools>` system block, Hermes `<tool_call>` JSON, tool results as `<tool_response>` in a user turn, an assistant
  turn after the last real user query showing its reasoning as `<think>\\n...\\n</think>\\n\\n`, earlier turns
  without it, and `enable_thinking=false` adding an empty think block to the generation prompt.
- "deepseek-v4": DeepSeek-V4's prompt format (the `encoding_dsv4` of DeepSeek's release, which its GGUFs carry as a
  Jinja template): system text first, `<｜User｜>` / `<｜Assistant｜>` turns, consecutive user and tool messages in one
  user turn (tool results as `<tool_result>`), tool calls as a DSML `<｜DSML｜tool_calls>` block, the tools'
  instructions and schemas appended to the system text, and the thinking mode (`thinking` or `enable_thinking`,
  default off): the generation prompt ends with `<think>` (on) or `</think>` (off); reasoning of earlier turns is
  kept only where the encoder keeps it (after the last user turn, or in a conversation with tools).
"""

from __future__ import annotations

QWEN3 = (
    "{%- set ns = namespace(query=messages|length - 1, multi=true) -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '"
    " + '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": '"
    " + '<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    # the last user message that is a real query (not tool results pasted into a user turn)
    "{%- for i in range(messages|length - 1, -1, -1) -%}"
    "{%- set m = messages[i] -%}"
    "{%- if ns.multi and m.role == 'user' and not ((m.content or '').startswith('<tool_response>')"
    " and (m.content or '').endswith('</tool_response>')) -%}"
    "{%- set ns.multi = false -%}{%- set ns.query = i -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set text = m.content or '' -%}{%- set thought = '' -%}"
    "{%- if m.reasoning_content is defined and m.reasoning_content is not none -%}"
    "{%- set thought = m.reasoning_content -%}"
    "{%- elif '</think>' in text -%}"
    "{%- set thought = text.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set text = text.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.query and (loop.last or thought) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' + text.lstrip('\\n') -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + text -}}{%- endif -%}"
    "{%- for call in (m.tool_calls or []) -%}"
    "{%- if text or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set f = call.function if call.function else call -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' -}}"
    "{{- f.arguments if f.arguments is string else (f.arguments | tojson) -}}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

_DS_TOOLS = (
    "## Tools\\n\\nYou have access to a set of tools to help answer the user\\'s question. You can invoke tools by "
    "writing a \"<｜DSML｜tool_calls>\" block like the following:\\n\\n<｜DSML｜tool_calls>\\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\\n<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">"
    "$PARAMETER_VALUE</｜DSML｜parameter>\\n...\\n</｜DSML｜invoke>\\n<｜DSML｜invoke name=\"$TOOL_NAME2\">\\n...\\n"
    "</｜DSML｜invoke>\\n</｜DSML｜tool_calls>\\n\\nString parameters should be specified as is and set "
    "`string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and "
    "set `string=\"false\"`.\\n\\nIf thinking_mode is enabled (triggered by <think>), you MUST output your complete "
    "reasoning inside <think>...</think> BEFORE any tool calls or final response.\\n\\nOtherwise, output directly "
    "after </think> with tool calls or final response.\\n\\n### Available Tool Schemas\\n\\n"
)

DEEPSEEK_V4 = (
    "{%- set think = thinking if thinking is defined else (enable_thinking if enable_thinking is defined else false) -%}"
    "{%- set st = namespace(sys='', first=true, last_user=-1, tool_results=false, in_user=false) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}"
    "{%- set st.sys = st.sys + ('' if st.first else '\\n\\n') + (m.content or '') -%}{%- set st.first = false -%}"
    "{%- endif -%}"
    "{%- if m.role in ['user', 'developer', 'tool'] -%}{%- set st.last_user = loop.index0 -%}{%- endif -%}"
    "{%- if m.role == 'tool' -%}{%- set st.tool_results = true -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}"
    "{%- set schemas = namespace(text='') -%}"
    "{%- for t in tools if t.type == 'function' -%}{%- set schemas.text = schemas.text + (t.function | tojson) + '\\n' -%}"
    "{%- endfor -%}"
    "{%- set block = '" + _DS_TOOLS + "' + schemas.text + '\\nYou MUST strictly follow the above defined tool name "
    "and parameter schemas to invoke tool calls.\\n' -%}"
    "{%- set st.sys = (st.sys + '\\n\\n' + block) if st.sys else block -%}"
    "{%- endif -%}"
    "{{- bos_token -}}"
    "{%- if think and reasoning_effort is defined and reasoning_effort == 'max' -%}"
    "{{- 'Reasoning Effort: Absolute maximum with no shortcuts permitted.\\nYou MUST be very thorough in your thinking "
    "and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic "
    "against all potential paths, edge cases, and adversarial scenarios.\\nExplicitly write out your entire "
    "deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to "
    "ensure absolutely no assumption is left unchecked.\\n\\n' -}}"
    "{%- endif -%}"
    "{{- st.sys -}}"
    "{%- for m in messages -%}"
    "{%- if m.role in ['user', 'developer', 'tool'] -%}"
    "{{- '\\n\\n' if st.in_user else '<｜User｜>' -}}{%- set st.in_user = true -%}"
    "{{- ('<tool_result>' + (m.content or '') + '</tool_result>') if m.role == 'tool' else (m.content or '') -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set st.in_user = false -%}"
    "{{- '<｜Assistant｜>' -}}"
    "{%- if think and ((drop_thinking is defined and not drop_thinking) or tools or loop.index0 > st.last_user"
    " or st.tool_results) -%}"
    "{{- '<think>' + (m.reasoning_content or '') + '</think>' -}}"
    "{%- else -%}{{- '</think>' -}}{%- endif -%}"
    "{{- m.content or '' -}}"
    "{%- if m.tool_calls -%}"
    "{{- '\\n\\n<｜DSML｜tool_calls>\\n' -}}"
    "{%- for call in m.tool_calls -%}"
    "{%- set f = call.function if call.function else call -%}"
    "{%- set args = (f.arguments | from_json) if f.arguments is string else (f.arguments or {}) -%}"
    "{{- '<｜DSML｜invoke name=\"' + f.name + '\">\\n' -}}"
    "{%- for key, value in args.items() -%}"
    "{%- if value is string -%}"
    "{{- '<｜DSML｜parameter name=\"' + key + '\" string=\"true\">' + value + '</｜DSML｜parameter>\\n' -}}"
    "{%- else -%}"
    "{{- '<｜DSML｜parameter name=\"' + key + '\" string=\"false\">' + (value | tojson) + '</｜DSML｜parameter>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if not args -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '</｜DSML｜invoke>\\n' -}}"
    "{%- endfor -%}"
    "{{- '</｜DSML｜tool_calls>' -}}"
    "{%- endif -%}"
    "{{- '<｜end▁of▁sentence｜>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' + ('<think>' if think else '</think>') -}}{%- endif -%}"
)


# Qwen3-style ChatML with Qwen3's tool block (tools in <tools></tools>, calls as <tool_call>{json}</tool_call>,
# results as <tool_response> in a user turn) and its `enable_thinking=False` empty think block.
DEFAULT = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{%- if message['role'] == 'system' %}"
    "{%- if not loop.first %}{{- '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'user' %}"
    "{{- '<|im_start|>user\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- if message['tool_calls'] %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if (loop.first and message['content']) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call['function'] %}{%- set tool_call = tool_call['function'] %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}"
    "{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}"
    "{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def chat_template(name: str) -> str:
    table = {"default": DEFAULT, "qwen3": QWEN3, "deepseek-v4": DEEPSEEK_V4}
    if name not in table:
        from betelgeuse.errors import InvalidRequestError
        raise InvalidRequestError(f"unknown chat template {name!r} (known: {', '.join(table)})")
    return table[name]
