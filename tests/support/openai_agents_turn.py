"""One agent turn with the OpenAI Agents SDK against a deployment; prints one JSON line.

Run by tests/integration/test_agent_clients.py with the Python of the agent clients' own venv
(`make agent-clients`), not the project's: the SDK is not in the development lock. The agent
has one tool and is made to call it (a named tool_choice: a random tiny model closes a call
only under the grammar); the SDK then runs the tool and, with ``run_llm_again``, sends its
result back with tool_choice reset to "auto" and takes the model's next answer as the final
output; with ``stop_on_first_tool`` the tool's result is the final output. (Over the
Responses API the SDK refuses an answer cut at max_output_tokens, status "incomplete", and
the tiny model never ends an answer by itself.) Usage:

    python openai_agents_turn.py BASE_URL MODEL chat|responses run_llm_again|stop_on_first_tool
    (the key in VLLM_API_KEY)
"""

from __future__ import annotations

import json
import os
import sys
from importlib.metadata import version
from typing import Literal

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

CALLS: list[dict] = []


@function_tool
def get_weather(city: Literal["Paris", "Oslo", "Lima"], unit: Literal["celsius", "fahrenheit"]) -> str:
    """Current weather for a city."""
    CALLS.append({"city": city, "unit": unit})
    return f"{city}: 18 degrees {unit}, light rain."


def main(base_url: str, model_id: str, api: str, behavior: str) -> int:
    set_tracing_disabled(True)  # tracing would export to OpenAI's servers
    client = AsyncOpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key=os.environ["VLLM_API_KEY"], max_retries=0)
    model_class = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    agent = Agent(
        name="weather",
        instructions="Answer with the weather. Use the tool.",
        tools=[get_weather],
        model=model_class(model=model_id, openai_client=client),
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=32, temperature=0),
        tool_use_behavior=behavior,
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    print(json.dumps({
        "openai_agents": version("openai-agents"),
        "openai": version("openai"),
        "tool_calls": CALLS,
        "items": [item.type for item in result.new_items],
        "final_output": result.final_output,
        "responses": len(result.raw_responses),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
