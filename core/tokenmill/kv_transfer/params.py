"""``kv_transfer_params``: what one request tells the KV connectors, and what they answer (vLLM's P/D shape).

A router sends a prefill engine ``{"do_remote_decode": true}``: compute the prompt and keep its
KV for a decode engine. The prefill engine's answer carries the params the decode engine needs
(``do_remote_prefill`` and where the KV is: ``remote_host``, ``remote_port``,
``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``), and the router forwards them
to the decode engine with the request. A connector may add fields of its own (extra fields are
kept); the ones named here are type-checked when the request arrives, so a wrong type is a 400
naming ``kv_transfer_params``, never a connector failing mid-step.

In the Python API they ride in ``SamplingParams.extra_args["kv_transfer_params"]`` (as in vLLM);
the answer is ``RequestOutput.kv_transfer_params``. An engine without a connector ignores them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from tokenmill.errors import InvalidRequestError

if TYPE_CHECKING:
    from tokenmill.request import Request

KV_TRANSFER_PARAMS = "kv_transfer_params"  # the key in SamplingParams.extra_args, and the request field


def _integral_float_as_int(value: Any) -> Any:
    """JSON Schema's ``integer`` includes ``105.0``; JSON clients (and JavaScript) may send one."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Integers as JSON says them (105 or 105.0, never "105", true or 105.5); the bounds sit inside the
# conversion so the schema shows them as minimum/maximum.
_Port = Annotated[Annotated[StrictInt, Field(ge=1, le=65535)], BeforeValidator(_integral_float_as_int)]
_BlockId = Annotated[Annotated[StrictInt, Field(ge=0)], BeforeValidator(_integral_float_as_int)]


class KVTransferParams(BaseModel):
    """The fields every connector reads the same way; unset fields are None ("not said")."""

    model_config = ConfigDict(extra="allow", frozen=True)

    do_remote_decode: StrictBool | None = Field(
        None, description="prefill side: keep this prompt's KV for a decode engine (the answer says where); "
                          "false: free it at once")
    do_remote_prefill: StrictBool | None = Field(
        None, description="decode side: the prompt's KV was computed elsewhere, load it; false: compute it here")
    remote_engine_id: StrictStr | None = Field(None, description="the engine that holds the KV")
    remote_host: Annotated[StrictStr, Field(min_length=1)] | None = Field(
        None, description="where that engine serves it")
    remote_port: _Port | None = None
    remote_request_id: StrictStr | None = Field(None, description="the request whose KV it keeps")
    remote_block_ids: list[_BlockId] | None = Field(
        None, description="its blocks there")

    @classmethod
    def parse(cls, value: Any) -> KVTransferParams | None:
        """``value`` checked, or None for no params; a wrong shape raises :class:`InvalidRequestError`."""
        if value is None:
            return None
        if isinstance(value, KVTransferParams):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{KV_TRANSFER_PARAMS} must be an object, got {type(value).__name__}",
                                      param=KV_TRANSFER_PARAMS)
        try:
            return cls.model_validate(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise InvalidRequestError(f"{KV_TRANSFER_PARAMS}.{where}: {first['msg']}",
                                      param=KV_TRANSFER_PARAMS) from None

    @classmethod
    def of(cls, request: Request) -> KVTransferParams | None:
        """The params ``request`` came with (checked when it was made), or None."""
        return cls.parse(request.sampling_params.extra_args.get(KV_TRANSFER_PARAMS))

    def answer(self) -> dict[str, Any]:
        """As JSON for a response: the fields that were set, extras included."""
        return self.model_dump(exclude_none=True)
