"""Inference engines behind one protocol: token ids in, token ids and sampled-token logprobs out."""
