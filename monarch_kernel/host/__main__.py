from monarch_kernel.host.agent import main

if __name__ == "__main__":
    main()
