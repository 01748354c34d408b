"""The operator dashboard: Plotly figures over the metrics streams, a Streamlit app that
shows them (`hack dashboard`), and the operator notebook that plots the same figures."""
