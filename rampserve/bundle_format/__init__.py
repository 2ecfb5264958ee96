"""What a prepared bundle holds and says about its model, readable without torch or ONNX Runtime: its files and
their digests (`manifest`), the tensors the model takes and gives (`signature`), its tokenizer (`text`) and its
latency profile (`latency`). The runtime writes and loads bundles with it; both sides of the server read it, the
front end without ever loading the model."""
