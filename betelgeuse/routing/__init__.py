"""Routing data: the trace file format with the engine's recorder and replayer (trace.py), readers for public traces
and profiles (public.py), and the routing a GGUF file produces through the reference model (measure.py). The
statistics themselves are betelgeuse/routing_stats.py (pure numpy, a floor below: the synthetic writers use them)."""
