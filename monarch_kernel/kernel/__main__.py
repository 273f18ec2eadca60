"""``python -m monarch_kernel.kernel -f CONNECTION_FILE``: start the kernel."""

from ipykernel.kernelapp import IPKernelApp

from monarch_kernel.kernel.kernel import MonarchKernel

if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=MonarchKernel)
