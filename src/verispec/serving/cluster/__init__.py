"""Scale-out on Ray (optional extra `verispec[ray]`): serving replicas on Ray Serve, batch jobs on Ray Data.

`serve` deploys the OpenAI-compatible app of `verispec.serving.http` as a Ray Serve deployment; `batch`
runs generation over a file of prompts with a pool of engine actors. Ray is imported only inside
these modules, so the rest of verispec works without it.
"""
