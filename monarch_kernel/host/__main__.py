from monarch_kernel.host.main import main

if __name__ == "__main__":
    main()
