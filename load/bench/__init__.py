"""What the appliance costs: per request in CPU and instructions, in throughput beside vLLM
and LiteLLM, and how soon it reacts and restarts."""
