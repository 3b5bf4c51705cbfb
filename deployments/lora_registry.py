"""The LoRA adapters a router lets requests name (issue 43): those every engine replica loads at start
(``lora_modules``) and those loaded at run time through vLLM's ``/v1/load_lora_adapter``, which the controller
lists for every router (``ControllerState.adapters``). The bodies and checks of vLLM's two endpoints live here;
the router passes its controller handle in."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from deployments import openai_protocol as oai


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` body: a PEFT folder on the server's machine, by name."""

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # vLLM's: replace an adapter of that name

    def check_supported(self) -> None:
        if self.load_inplace:
            raise oai.APIError("load_inplace: replacing a loaded adapter is not supported; unload it first",
                               param="load_inplace")


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(min_length=1)

    def check_supported(self) -> None:
        pass


class AdapterRegistry:
    def __init__(self, lora_modules: dict[str, str], served_model_name: str) -> None:
        self.static = dict(lora_modules)  # {name: folder}, registered by every replica at start (max_loras in slots)
        self.runtime: dict[str, str] = {}  # {name: folder}, as the controller lists them
        self.served_model_name = served_model_name

    def paths(self) -> dict[str, str]:
        """Every adapter a request may name: {name: its folder}."""
        return {**self.static, **self.runtime}

    def for_requests(self) -> dict[str, str | None]:
        """{name: the folder a replica loads it from on its first request for it; None: registered at start}."""
        return {**dict.fromkeys(self.static), **self.runtime}

    def model_cards(self, created: int, max_model_len: int) -> list[dict]:
        """``/v1/models`` entries, one per adapter, with its ``parent`` (as vLLM lists them)."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "apt-serve-ray", "root": path,
                 "parent": self.served_model_name, "max_model_len": max_model_len}
                for name, path in self.paths().items()]

    def check_load(self, body: LoadLoRAAdapterRequest) -> None:
        """``APIError`` naming the field unless ``body`` names a new adapter in a folder we can serve."""
        name = body.lora_name
        if not name.strip() or name != name.strip():
            raise oai.APIError("lora_name: must not be blank or start or end with spaces", param="lora_name")
        if name == self.served_model_name or name in self.paths():
            raise oai.APIError(f"lora_name: the adapter `{name}` has already been loaded", param="lora_name")
        from apt_serve_ray.lora.peft import check_folder

        try:
            check_folder(body.lora_path)
        except ValueError as exc:
            raise oai.from_value_error(exc) from None

    def check_unload(self, body: UnloadLoRAAdapterRequest) -> None:
        if body.lora_name in self.static:
            raise oai.APIError(f"lora_name: `{body.lora_name}` was loaded at start (lora_modules) and stays",
                               param="lora_name")

    async def load(self, body: LoadLoRAAdapterRequest, controller) -> dict[str, str]:
        """Check ``body`` and have the controller list the adapter for every router; the new run-time list."""
        self.check_load(body)
        await controller.set_adapter.remote(body.lora_name, body.lora_path)
        return {**self.runtime, body.lora_name: body.lora_path}

    async def unload(self, body: UnloadLoRAAdapterRequest, controller) -> dict[str, str]:
        """Check ``body`` and have the controller drop the adapter; the new run-time list."""
        name = body.lora_name
        self.check_unload(body)
        if not await controller.remove_adapter.remote(name):
            raise oai.APIError(f"lora_name: no adapter `{name}` is loaded", status=404, param="lora_name",
                               code="model_not_found")
        return {n: p for n, p in self.runtime.items() if n != name}
