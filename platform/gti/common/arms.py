"""What an arm is made of and what it is called, defined once for the config, the building
blocks and the reports.

What it is for: the initialisation methods (`INIT_METHODS`, which `init.method` accepts and
`gti.lm.init.init_rows` implements), the default grounding-task templates (which
`pairs.templates` may override, one per task), and the name of an arm (`arm_name`: how a run
is called in the ground stage's facts and in reports when `report.label` is not set).

What it does not know: what any of them computes. It imports nothing from gti.
"""

from __future__ import annotations

INIT_METHODS: tuple[str, ...] = ("mean", "mean_noise", "random", "description", "codebook")

DEFAULT_GROUNDING_TEMPLATES: dict[str, str] = {
    "title2sid": "Which item has the title: {title}?",
    "desc2sid": "Can you tell me what item is described as {description}?",
    "titledesc2sid": "What item is called {title} and described as {description}?",
    "sid2title": "Could you please tell me what item {sid} is called?",
    "sid2desc": "Briefly describe item {sid}.",
    "sid2titledesc": "What is the title and description of item {sid}?",
}


def arm_name(init_method: str, grounded: bool, multitask: bool = False, rl: bool = False) -> str:
    """The arm a run belongs to: `gti` (mean init + grounding, the paper's method),
    `gti+<method>` (another init + grounding), `<method>` (no grounding); `+multitask` when
    SFT mixes in the grounding pairs (LC-Rec style), then `+rl` when GRPO trained after SFT
    (e.g. `gti+rl`, `gti+multitask+rl`)."""
    if grounded:
        name = "gti" if init_method == "mean" else f"gti+{init_method}"
    else:
        name = init_method
    return name + ("+multitask" if multitask else "") + ("+rl" if rl else "")
