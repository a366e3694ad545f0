"""Building: the plan compiled into a Triton cache dir on a build host, without the accelerator where the target allows
(``build``, ``backends``: one target per accelerator and mode, ``workers``), autotuning results applied or benchmarked
(``autotune``, ``tune``), the compiler front end only (``lower``), present entries found by their keys (``probe``,
``keys``), and the seam to each Triton version (``tritoncompat``)."""
