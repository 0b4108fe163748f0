from jaxinfer.config import ModelConfig, SamplingParams, RequestOutput, CompletionOutput, Logprob
