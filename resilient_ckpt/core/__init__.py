"""The pure core: names, manifests, strict JSON, codecs, box arithmetic, pytrees,
restore planning, step selection, retention and the rules of agreement between
processes. No I/O, no threads, no clocks: functions over frozen dataclasses that
the property tests drive directly."""
