"""Generation engines for machines without vLLM: a Hugging Face causal LM behind each host's interface.

``hf_engine.HFEngine`` is the host-free core (decoding in ``decoding.py``, sampling in ``sampling.py``,
checked weight updates in ``weight_updates.py``, our own broadcast group in ``broadcast.py``). Each host
version gets a face: ``cpu_engine.py`` for skyrl-train 0.3.1 (its engine interface, as Ray actors),
``client.py`` for skyrl 0.4 (its inference client over engine actors). Import the module you need:
the faces import the installed host.
"""
