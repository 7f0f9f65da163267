"""The rig's scripted workloads: what each simulated phone asks, request by request.

* ``chat``: held-out single-turn questions (written for the rig; none comes from the calibration text in
  ``partition_tools/data``), each a fresh conversation.
* ``agent``: the AutoGLM agent loop: the long fixed system prompt (``edge_client/data/
  autoglm_system_prompt.txt``, 2.7 KB English) re-sent every step with the task, the history of actions and
  the current screen; short action outputs. Text-only: a step's screen is a textual description, since the
  rig's models (SmolLM2, tiny-glm4) have no vision tower. The loop with real screenshot uploads through
  ``EdgeClient``'s image parts is measured on a GLM-4.1V-shaped bundle in docs/performance.md, "The AutoGLM
  agent loop through the real server".

A workload is a list of :class:`Request`; phone ``i`` of a burst starts at a different offset of the list so
concurrent phones do not all send the same prompt at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CHAT_PROMPTS = (
    "What is the difference between a virus and a bacterium? Answer in two sentences.",
    "Give me three tips for keeping a phone battery healthy.",
    "Why does the sky look blue during the day and red at sunset?",
    "Explain what a hash table is to someone who has never programmed.",
    "Suggest a name for a small bakery that sells sourdough bread, and say why.",
    "How do I convert 72 degrees Fahrenheit to Celsius? Show the steps.",
    "What should I pack for a two-day hiking trip in the mountains?",
    "Summarize the water cycle in four short steps.",
    "Is it better to rent or to buy a car for a one-week holiday? Give the main trade-offs.",
    "Write a polite two-line message declining a meeting invitation.",
    "Why do airplanes fly at around ten kilometres altitude?",
    "What are the first things to check when a laptop will not turn on?",
)

AGENT_TASKS = (
    ("Set an alarm for 7:30 tomorrow morning.", (
        "Home screen. Icons: Phone, Messages, Camera, Clock, Settings, Maps, Calendar. Status bar: 21:04.",
        "Clock app, Alarm tab. List: 06:45 (off), 08:00 (off). Button '+' at [540,2100].",
        "New alarm dialog. Hour wheel shows 06, minute wheel shows 00. Buttons: Cancel, OK.",
        "New alarm dialog. Hour wheel shows 07, minute wheel shows 00. Buttons: Cancel, OK.",
        "New alarm dialog. Hour wheel shows 07, minute wheel shows 30. Buttons: Cancel, OK.",
        "Clock app, Alarm tab. List: 06:45 (off), 07:30 (on, tomorrow), 08:00 (off).",
    )),
    ("Send a message to Anna saying I will be ten minutes late.", (
        "Home screen. Icons: Phone, Messages, Camera, Clock, Settings, Maps, Calendar. Status bar: 18:12.",
        "Messages app. Conversations: Anna (yesterday), Bank (Monday), Tom (last week). Search bar on top.",
        "Conversation with Anna. Last message: 'See you at six!'. Text field 'Message' at [480,2250].",
        "Conversation with Anna. Keyboard open. Text field is empty and focused.",
        "Conversation with Anna. Text field: 'I will be ten minutes late.' Send button at [1000,2250].",
        "Conversation with Anna. Last message (sent): 'I will be ten minutes late.'",
    )),
    ("Turn on Wi-Fi and connect to the network called Home-5G.", (
        "Home screen. Icons: Phone, Messages, Camera, Clock, Settings, Maps, Calendar. Status bar: 09:40.",
        "Settings. Items: Network & internet, Connected devices, Apps, Battery, Display, Sound.",
        "Network & internet. Items: Internet (off), SIMs, Airplane mode (off), Hotspot & tethering.",
        "Internet. Wi-Fi toggle (off). Mobile network: Carrier 4G.",
        "Internet. Wi-Fi toggle (on). Networks: Home-5G (secured), Cafe-Free (open), Neighbour (secured).",
        "Wi-Fi password dialog for Home-5G. Password field focused. Buttons: Cancel, Connect.",
    )),
)


@dataclass(frozen=True, slots=True)
class Request:
    messages: list[dict]
    max_tokens: int
    label: str  # "chat/3", "agent/1/4": workload, item, step

    def to_dict(self) -> dict:
        return {"messages": self.messages, "max_tokens": self.max_tokens, "label": self.label}


def system_prompt() -> str:
    """The AutoGLM agent's fixed system prompt (the same file the edge's preload and benchmarks use)."""
    import edge_client

    return (Path(edge_client.__file__).parent / "data" / "autoglm_system_prompt.txt").read_text(encoding="utf-8")


def chat_requests(n: int, max_tokens: int, offset: int = 0) -> list[Request]:
    """``n`` single-turn questions, starting at ``offset`` in the list (wrapping around)."""
    out = []
    for i in range(n):
        k = (offset + i) % len(CHAT_PROMPTS)
        out.append(Request([{"role": "user", "content": CHAT_PROMPTS[k]}], max_tokens, f"chat/{k}"))
    return out


def agent_requests(steps: int, max_tokens: int, offset: int = 0) -> list[Request]:
    """``steps`` agent steps over the scripted tasks (a task's screens in order, then the next task).

    Each step re-sends the system prompt, the task, the actions so far (scripted, so every mode and run sees
    the same history whatever the model answered) and the current screen."""
    prompt = system_prompt()
    out: list[Request] = []
    t = offset % len(AGENT_TASKS)
    while len(out) < steps:
        task, screens = AGENT_TASKS[t]
        history: list[str] = []
        for s, screen in enumerate(screens):
            if len(out) == steps:
                break
            user = (f"Task: {task}\nPrevious actions: {'; '.join(history) if history else 'none'}\n"
                    f"Current screen: {screen}\nWhat is the next action?")
            out.append(Request([{"role": "system", "content": prompt}, {"role": "user", "content": user}],
                               max_tokens, f"agent/{t}/{s}"))
            history.append(f"step {s + 1}: acted on '{screen.split('.')[0]}'")
        t = (t + 1) % len(AGENT_TASKS)
    return out


def build(kind: str, count: int, max_tokens: int, offset: int = 0) -> list[Request]:
    if kind == "chat":
        return chat_requests(count, max_tokens, offset)
    if kind == "agent":
        return agent_requests(count, max_tokens, offset)
    raise ValueError(f"workload kind {kind!r}: expected chat or agent")
