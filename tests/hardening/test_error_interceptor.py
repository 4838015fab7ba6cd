"""protos/errors.py: what escapes a model service's handler ends that call with a typed status and a message naming
it (not grpc's UNKNOWN), on unary and stream calls, and the service goes on serving."""
from __future__ import annotations

import grpc
import pytest

from protos.errors import status_for
from protos.tandem.v1 import tandem_pb2 as pb
from tests.stack import local_stack
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("errors"))


def test_status_mapping():
    assert status_for(ValueError("bad tree")) == (grpc.StatusCode.INVALID_ARGUMENT, "bad tree")
    assert status_for(TimeoutError())[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    code, message = status_for(RuntimeError("CUDA error: an illegal memory access"))
    assert code == grpc.StatusCode.INTERNAL and "RuntimeError" in message and "illegal memory" in message


async def test_a_handler_error_is_a_typed_status_on_unary_and_stream_calls_and_the_service_lives_on(tiny):
    async with local_stack(tiny) as scheduler:
        target = scheduler.targets.clients[0]
        engine = scheduler.test_engine
        real = engine.verify

        def broken(inputs):
            raise RuntimeError("device fell over")

        engine.verify = broken
        request = pb.VerifyRequest(seqs=[pb.VerifySeq(seq_id="nobody", committed_len=2, root_token_id=1,
                                                      stop=pb.StopParams(max_new_tokens=4))])
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await target.stub.Verify(request, timeout=10)
        assert unary.value.code() == grpc.StatusCode.INTERNAL
        assert "RuntimeError: device fell over" in unary.value.details()
        call = target.stub.VerifyStream()
        await call.write(request)
        with pytest.raises(grpc.aio.AioRpcError) as stream:
            await call.read()
        assert stream.value.code() == grpc.StatusCode.INTERNAL and "device fell over" in stream.value.details()
        engine.verify = real
        response = await target.stub.Verify(request, timeout=10)  # the same service answers the next call
        assert len(response.results) == 1
