"""Benchmarks: method x metric tables from the results store."""

import streamlit as st

from ui import common

common.page_setup()

st.title("Benchmarks")
st.info("The benchmark runner is being built (issue 3); this page will read its results store.")
