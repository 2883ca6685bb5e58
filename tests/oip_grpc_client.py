"""Triton's gRPC client (`tritonclient.grpc`) calling a gateway's Open Inference Protocol port, run by
tests/test_kserve_grpc_client.py under .venv-oip's python (tritonclient pins a protobuf bouquet's own environment
cannot take). Reads a JSON job on stdin ({"url", "model", "key", "texts", "mode"}, and "tls": the PEM files' paths
{"ca", "cert", "key"} for a gateway serving TLS) and prints one JSON object: what
the client got from each call, its errors as the client raises them (status and message), and the fields of
tritonclient's own messages (names, numbers, types) for the test to compare with bouquet's proto."""

from __future__ import annotations

import json
import sys

import numpy as np
import tritonclient.grpc as triton
from google.protobuf import descriptor_pb2
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException


def infer(client, job, texts, datatype="BYTES", model=None, headers=None, parameters=None):
    tensor = triton.InferInput("text", [len(texts)], datatype)
    if datatype == "BYTES":  # serialised as raw_input_contents, each element length-prefixed
        tensor.set_data_from_numpy(np.array(texts, dtype=object))
    else:
        tensor.set_data_from_numpy(np.ones(len(texts), np.float32))
    outputs = [triton.InferRequestedOutput("embedding")]
    headers = {"authorization": f"Bearer {job['key']}"} if headers is None else headers
    result = client.infer(
        model or job["model"], [tensor], outputs=outputs, headers=headers, parameters=parameters, request_id="r-1"
    )
    response = result.get_response()
    return {"rows": result.as_numpy("embedding").tolist(), "model_name": response.model_name, "id": response.id}


def refusal(call):
    try:
        call()
    except InferenceServerException as error:
        return {"status": error.status(), "message": error.message()}
    return None


def fields():
    """tritonclient's messages, flattened: "Message.Nested" -> [[field, number, type, label, message type]]."""
    found = {}
    proto = descriptor_pb2.FileDescriptorProto()
    service_pb2.DESCRIPTOR.CopyToProto(proto)

    def walk(messages, prefix):
        for message in messages:
            found[prefix + message.name] = [
                [f.name, f.number, f.type, f.label, f.type_name.rsplit(".", 1)[-1]] for f in message.field
            ]
            walk(message.nested_type, prefix + message.name + ".")

    walk(proto.message_type, "")
    return {"package": proto.package, "messages": found}


def connect(job):
    tls = job.get("tls")
    if tls is None:
        return triton.InferenceServerClient(job["url"])
    return triton.InferenceServerClient(  # the client takes the PEM files' paths
        job["url"], ssl=True, root_certificates=tls["ca"], private_key=tls["key"], certificate_chain=tls["cert"]
    )


def main() -> None:
    job = json.load(sys.stdin)
    client = connect(job)
    auth = {"authorization": f"Bearer {job['key']}"}
    if job["mode"] == "overload":
        print(json.dumps({"overload": refusal(lambda: infer(client, job, job["texts"]))}))
        return
    if job["mode"] == "tls":
        ready = {"ready": client.is_server_ready(), "model_ready": client.is_model_ready(job["model"])}
        print(json.dumps({**ready, "infer": infer(client, job, job["texts"])}))
        return
    metadata = client.get_model_metadata(job["model"], headers=auth, as_json=True)
    answer = {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "model_ready": client.is_model_ready(job["model"]),
        "server": client.get_server_metadata(headers=auth, as_json=True),
        "metadata": metadata,
        "infer": infer(client, job, job["texts"]),
        "dimensions": infer(client, job, job["texts"], parameters={"dimensions": 32}),
        "errors": {
            "unknown_model": refusal(lambda: infer(client, job, job["texts"], model="no-such-model")),
            "fp32_tensor": refusal(lambda: infer(client, job, job["texts"], datatype="FP32")),
            "empty_text": refusal(lambda: infer(client, job, ["a", ""])),
            "no_key": refusal(lambda: infer(client, job, job["texts"], headers={})),
            "bad_dimensions": refusal(lambda: infer(client, job, job["texts"], parameters={"dimensions": 4096})),
            "metadata_of_unknown": refusal(lambda: client.get_model_metadata("no-such-model", headers=auth)),
        },
        "triton_proto": fields(),
    }
    client.close()
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
