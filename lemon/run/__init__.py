"""Running specs: the shipped model files (`models`), LLM backends (`backends`), the capacity pool, fake and token meter
(`workers`), the DAG executor with its node cache (`executor`) and the process sandbox for generated code
(`sandbox`)."""
