"""The load generator and measurement core of `sparkctl bench`: vLLM's serving metrics, and the model card's table.

Every request is timed as `vllm bench serve` times it (benchmetrics: TTFT, TPOT, ITL, E2EL, request and
output throughput, under vLLM's names); the level's figures are benchmetrics.serving_metrics over its
requests. Two quantities are sparkctl's own, for the model card's table (README, "bench"):

- per-stream decode tok/s = (N − 1) ÷ (E2EL − TTFT) = 1 ÷ TPOT per request, N the usage chunk's
  completion_tokens (a server that sends no usage gets its chunks counted, flagged: with speculative
  decoding a chunk can carry several tokens). C1's table cell is its mean; "Cn agg" is C × the level's
  mean per-stream rate (the card's "summed across streams"). vLLM's output_throughput (all output
  tokens ÷ duration, TTFT and queueing included) sits beside it.
- accepted tok/step = 1 + Δaccepted ÷ Δdrafts over the level, from the server's /metrics counters
  vllm:spec_decode_num_accepted_tokens_total and vllm:spec_decode_num_drafts_total (vLLM's "mean
  acceptance length", spec_decode_acceptance_length in its result). The counters are server-wide:
  other traffic during a level pollutes this figure (the per-request figures are unaffected).

Sampling is the card's benchmark sampling: temperature 0.6, top_p 0.95, thinking off
(chat_template_kwargs.enable_thinking=false), 256-token outputs forced with ignore_eos. A server that
rejects ignore_eos / chat_template_kwargs / stream_options with HTTP 400 gets them dropped (noted).

Load shapes: a closed loop of C streams (each sends its next request when the last one ends), or with
a request rate, requests arriving as vLLM's benchmark schedules them (Poisson) with at most C in
flight (vLLM's --max-concurrency); a level ends after its number of requests or its --duration.

The client must not become the bottleneck it measures: each stream is one thread on a raw socket,
woken per packet (ITL needs every chunk's time); where the kernel timestamps packets (SO_TIMESTAMPNS,
Linux) a chunk is dated to its packet's arrival, not to when the thread woke up. bench/loadgen_cpu.py
measures the client's CPU per stream.

The package, one job per module:
  inputs    the workloads, the sampling defaults, --concurrency's list (the endpoint: headapi.Endpoint)
  wire      HTTP chunked bodies, server-sent events, the spec-decode counters
  request   one streamed request on a raw socket, and the plain calls beside it
  level     one level (BenchConfig, Sampling, run_level) and the run's document (BenchRun)
  replicas  several replicas in step (LevelSync) and their total
  report    the JSON document's schema, a saved run, the tables, --compare
The flow of a whole run (warm-up, the levels, several replicas, `--tool vllm`, `--tool llama-benchy`) is
orchestrate.bench; /metrics is parsed by promtext.
"""
