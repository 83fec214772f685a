# Declarations for the compiled build of cai.py (Cython pure-Python mode).
cimport cython
from sharedmem.allocation cimport View, ViewToken
from sharedmem.buffer cimport Buffer
from sharedmem.tensor cimport Tensor

@cython.locals(tok=ViewToken, t=Tensor, b=Buffer)
cpdef dict cai_layout(View view, bint read_only)
