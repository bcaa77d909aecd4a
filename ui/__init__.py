"""The command line (typer + rich) and the Streamlit dashboard (plotly figures)."""
