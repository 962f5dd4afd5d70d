"""The measured-host cost model: a host ``plait calibrate`` measured, running plait's own eager runtime.

``profile`` (the calibration's TOML format), ``shapes`` (what calibrate times), ``census`` (what plait's eager
Llama saves and runs), ``experts`` (what its mixture-of-experts layers save beyond a dense MLP), ``compute``
(its compute at the measured speeds), ``sharing`` (processes sharing cores), ``costs`` (the ``CostModel`` a
``Cluster.from_profile`` uses).
"""
