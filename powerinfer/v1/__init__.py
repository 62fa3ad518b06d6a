"""The gRPC client stubs of `powerinfer.v1.Inference`, generated from
`protos/powerinfer/v1/inference.proto` when the package is built (`make protos` in a checkout):

    import grpc
    from powerinfer.v1 import inference_pb2 as pb, inference_pb2_grpc

    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel("127.0.0.1:9000"))
    for r in stub.Generate(pb.GenerateRequest(model="smollm2-135m-instruct", text="Hello")):
        print(r.text, end="")

They live in the library package, under the proto's own package name, so `powerinfer.v1` is
what `python -m grpc_tools.protoc -I protos ...` would generate too, and nothing shadows it.
"""
