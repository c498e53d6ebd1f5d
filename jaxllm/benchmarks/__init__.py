"""The `jaxllm bench throughput | latency | sweep` commands: vLLM-style benchmarks with a same-run
baseline (HF transformers), a roofline, a matmul floor and a per-step host-time profile. The method
is described in the `jaxllm bench --help` text (jaxllm/entrypoints/cli/benchmark.py, which
builds the parser and imports these modules only when a command runs).

  datasets.py      workloads: synthetic random-token prompts, JSON / JSONL records
  metrics.py       throughput and latency metrics (jaxllm and HF alike)
  common.py        what every command shares: the engine from the flags, warm-up, checks, JSON
  throughput.py    `bench throughput`
  latency.py       `bench latency`
  sweep.py         `bench sweep` and its plot
  hf_runner.py     the HF transformers baseline (`--compare-hf`)
  roofline.py      machine measurement (GEMM rate, bandwidth), workload cost, the roofline
  matmul_floor.py  a run's step shapes re-timed through nothing but the weight matmuls
  profile.py       `--profile`: host time per decode step, by phase

They reach the engine only through its public interface: per-step stats, and the model runner's
step-shape counts, weight stats and time_weight_matmuls through `LLM.collective_rpc`; never the
core's objects.
"""
