"""The vLLM plugin (entry point ``vllm.general_plugins``: ``specdraft = specdraft.serving.vllm_plugin:register``).

vLLM calls ``register`` in every process it starts; it registers the draft architectures vLLM lacks
by name (the classes are imported only when a checkpoint asks for one). A draft config's architecture
``X`` becomes ``EagleX`` under ``method: "eagle"`` unless it already starts with ``Eagle``, and
``Eagle3X`` under ``"eagle3"`` unless it starts or ends with ``Eagle3`` (vLLM's ``EAGLEConfig``), so
the names the exporter writes are already in their final form.

Installed with specdraft; a serving image needs only the package itself (``pip install --no-deps
specdraft``: this module imports nothing but vLLM).
"""

from __future__ import annotations

MODELS = "specdraft.serving.vllm_models"
ARCHITECTURES = {  # what ``specdraft export --format vllm`` writes -> the class vLLM builds
    "EagleSpecdraftLlamaForCausalLM": f"{MODELS}:SpecdraftEagleForCausalLM",
    "EagleSpecdraftBeagleForCausalLM": f"{MODELS}:SpecdraftBeagleForCausalLM",
    "Eagle3SpecdraftBeagleForCausalLM": f"{MODELS}:SpecdraftBeagle3ForCausalLM",
}


def register() -> None:
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for arch, cls in ARCHITECTURES.items():
        if arch not in supported:  # vLLM loads plugins once per process, but may do so in many processes
            ModelRegistry.register_model(arch, cls)
