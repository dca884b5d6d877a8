"""The papermill study: profiles, folder layout and runner (`runner`; `python -m lemon.study`), what each notebook
computes (`stages`), plots and summary.md (`plots`), the ipywidgets spec inspector (`widgets`)."""
