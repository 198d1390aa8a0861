"""Pipeline features, each a `PipelineExtension`: vocabulary parallelism (with its output-pass
placement) and attention context exchange (with its plan)."""
