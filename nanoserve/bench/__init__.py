"""Benchmarks for nanoserve: workloads, one step driver, the roofline model of a run, peers
(HF transformers, vLLM's CPU backend) and reports. `bench.py` at the repository root is the CLI;
`python -m nanoserve.bench` is the same.

    workloads.py     the requests (token ids, lengths, arrivals) of each workload
    driver.py        steps an LLM's engine and records each step (StepStats.entries)
    model_shape.py   FLOPs and bytes of a step, from config.json
    roofline.py      GEMM peak and weight-streaming bandwidth measured now; per-step floors
    results.py       a run's figures; report.py prints them and the comparisons
    machine.py       CPU, flags, threads, load, and what the engine ran
    checkpoints.py   --model / --arch: which checkpoint
    experiments.py   what each workload measures; profiler.py: torch.profiler tables
    peers/           hf.py, vllm.py (+ vllm_worker.py, run by vLLM's own interpreter), start.py
    cli.py           flags and main()
"""
